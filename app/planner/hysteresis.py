"""When to replace the published averaging plan: hysteresis against churn and measurement noise."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from app.planner.lp import plan_averaging, round_seconds
from app.planner.model import BANDWIDTH_ONLY, PeerProfile, Plan, PlanningError, RoundCosts
from app.planner.step import StepOptions, plan_cost, plan_round_seconds, plan_step


class Replanner:
    """Decides whether a freshly solved plan replaces the current one.

    A new plan is solved when the peers differ from those of the last solve (a peer joined or left, or a peer's
    measured profile changed), at most once per ``min_interval_s``. It is published only if it predicts a round
    more than ``min_improvement`` faster than the current plan would take on the same peers (peers the current
    plan does not name count with share zero, as hivemind would run them), so that noise in bandwidth
    measurements never makes the swarm flip between near-equal plans. With ``step``, plans are compared by step
    time; a plan that gives some peer another role (who aggregates: what the compute term decides) needs to win
    that fraction of the current plan's round only, as under delayed updates a step is mostly compute and what a
    plan wins by moving aggregating off a fast trainer is a small part of it. Shares alone still need the fraction
    of the step, so that a new plan (and the rounds its peers lose while they take it up) stays rare.
    A current plan that names a peer that has left is replaced at once, whatever the interval: a round planned around
    an absent peer cannot finish. A peer whose compute the current plan only guessed (it joined before its first
    rate: ``update``'s ``guessed``) is planned again once it is measured, and a plan that then gives some peer
    another role is published whatever the gain: the current roles rest on no figure. That happens once per peer,
    so measurement noise cannot make roles alternate through it.

    :param vector_bytes: size of the averaged vector, bytes
    :param clock: returns the current time in seconds (``time.monotonic`` in production; tests pass their own)
    :param min_improvement: fraction by which the predicted round time must drop to publish (0.05 is 5%)
    :param min_interval_s: least seconds between two solves, unless a named peer has left
    :param hold_back: model hivemind 1.1.12's hold-back of results for zero-share peers (see ``app.planner.lp``)
    :param min_share: the floor share of every sender for these peers (``plan_averaging``'s ``min_share``)
    :param step: plan the whole optimizer step, in groups (``plan_step``) and compare plans by step time; None plans
      the averaging round alone (``plan_averaging``)
    :param costs: what a round costs besides bandwidth; ``costs`` may be set again as rounds are measured
    """

    def __init__(
        self,
        *,
        vector_bytes: float,
        clock: Callable[[], float],
        min_improvement: float = 0.05,
        min_interval_s: float = 30.0,
        hold_back: bool = True,
        min_share: Callable[[list[PeerProfile]], float | None] = lambda peers: None,
        step: StepOptions | None = None,
        costs: RoundCosts = BANDWIDTH_ONLY,
    ) -> None:
        if not 0.0 <= min_improvement < 1.0:
            raise PlanningError(f"min_improvement is a fraction in [0, 1), got {min_improvement}")
        if min_interval_s < 0:
            raise PlanningError(f"min_interval_s must be >= 0 seconds, got {min_interval_s}")
        self._vector_bytes = vector_bytes
        self._clock = clock
        self._min_improvement = min_improvement
        self._min_interval_s = min_interval_s
        self._hold_back = hold_back
        self._min_share = min_share
        self._step = step
        self.costs = costs
        self._current: Plan | None = None
        self._solved_for: frozenset[PeerProfile] | None = None
        self._solved_at = 0.0
        self._guessed: frozenset[str] = frozenset()  # peers the current plan planned without a measured rate
        self.last_reason = "no update yet"  # why the last update published or kept a plan, for logs

    @property
    def current(self) -> Plan | None:
        """The plan published last, or None before the first ``update``."""
        return self._current

    def update(self, peers: Iterable[PeerProfile], guessed: Iterable[str] = ()) -> Plan | None:
        """Consider the peers present now; returns the plan to publish, or None to keep the current one.

        :param guessed: the peers whose ``samples_per_second`` is a stand-in, not their own measured rate
        """
        peers, guessed = list(peers), frozenset(guessed)
        key = frozenset(peers)
        if self._current is None:
            return self._publish(self._solve(peers, key), "first plan", guessed)
        if self._names_departed(peers):
            return self._publish(self._solve(peers, key), "a peer named by the plan left", guessed)
        if key == self._solved_for:
            return self._keep("peers unchanged")
        if self._clock() - self._solved_at < self._min_interval_s:
            return self._keep("peers changed, but the last plan is too recent")
        candidate = self._solve(peers, key)
        if any(p.peer not in self._current.shares for p in peers):
            # the plan does not name a peer that is here: its averager falls back to hivemind's own fraction for
            # it, which the model does not describe, and it gets no attestation floor; however small the gain
            return self._publish(candidate, "a peer the plan does not name joined", guessed)
        measured_now = self._guessed - guessed
        self._guessed &= guessed  # each peer's first measurement counts once
        if measured_now and candidate.roles != self._current.roles:
            return self._publish(candidate, "a peer's compute the plan guessed was measured", guessed)
        if self._improves(candidate, peers):
            return self._publish(candidate, "new plan is faster by more than the threshold", guessed)
        return self._keep("new plan is not faster by more than the threshold")

    def _solve(self, peers: list[PeerProfile], key: frozenset[PeerProfile]) -> Plan:
        if self._step is not None:
            plan = plan_step(peers, self._vector_bytes, self._step, min_share=self._min_share,
                             hold_back=self._hold_back, costs=self.costs)
        else:
            plan = plan_averaging(peers, self._vector_bytes, hold_back=self._hold_back,
                                  min_share=self._min_share(peers), costs=self.costs)
        self._solved_for, self._solved_at = key, self._clock()
        return plan

    def _names_departed(self, peers: list[PeerProfile]) -> bool:
        assert self._current is not None
        return not set(self._current.shares) <= {p.peer for p in peers}

    def _improves(self, candidate: Plan, peers: list[PeerProfile]) -> bool:
        assert self._current is not None
        try:
            if self._step is not None:
                current = plan_cost(peers, self._current, self._vector_bytes, self._step, hold_back=self._hold_back,
                                    costs=self.costs)
                scale = plan_round_seconds(peers, self._current, self._vector_bytes, hold_back=self._hold_back,
                                           costs=self.costs)
            else:
                current = scale = round_seconds(peers, self._current.shares, self._vector_bytes,
                                                hold_back=self._hold_back, costs=self.costs)
        except PlanningError:
            return True  # the current shares no longer fit, e.g. an aggregator switched to client mode
        new = candidate.step_seconds if self._step is not None and candidate.step_seconds is not None \
            else candidate.predicted_seconds
        gain = current - new
        if gain > self._min_improvement * current:
            return True
        return self._step is not None and candidate.roles != self._current.roles \
            and gain > self._min_improvement * scale

    def _publish(self, plan: Plan, reason: str, guessed: frozenset[str]) -> Plan:
        self._current, self.last_reason = plan, reason
        self._guessed = guessed & set(plan.shares)
        return plan

    def _keep(self, reason: str) -> Plan | None:
        """What ``update`` returns to keep the current plan: None."""
        self.last_reason = reason
        return None
