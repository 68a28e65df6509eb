"""The local-updates training algorithm (DiLoCo) as a collaborative optimizer (docs/training-algorithms.md).

hivemind's ``Optimizer`` with ``use_local_updates``: every mini-step is an optimizer step of this peer's own (the run's
optimizer options are the inner optimizer's), the swarm's epoch advances when the peers' samples since the last one
reach the run's outer batch, and each epoch is an outer round of the state averager, here a
``training.outer.OuterAverager``: pseudo-gradients averaged by the plan with receipts, the outer Nesterov step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional

from hivemind.utils import get_dht_time, get_logger

from dedloc_worker.training.optimizer import AccountedOptimizer, FinishedEpoch
from dedloc_worker.training.outer import OuterAverager

logger = get_logger(__name__)

# After a missed overlapped round: looks for a newer outer state, this many seconds apart
CATCH_UP_TRIES, CATCH_UP_SPACING = 3, 1.0
# A round overlaps the next inner steps while the last one took at most this share of its phase: the inner steps
# taken during a round start from parameters one outer step old, which cost little at 16% (held-out loss 1.663
# overlapped, 1.669 waiting) and much at 64% (2.69 against 1.74; bench/results/local_updates.md). Once overlapping,
# a peer waits again past WAIT_SHARE only: rounds near the threshold (20-38% of a phase in a run of the swarm test)
# switched every round, a line each time
OVERLAP_SHARE, WAIT_SHARE = 0.25, 0.4


@dataclass
class _OuterRound:
    """The outer round an epoch closed with, until it has ended."""

    epoch: int
    rounds_before: int  # the averager's outer rounds before it: one more once it is applied
    alone: bool  # no other peer was in the swarm: stepped alone, or took the state of the peer that was


class LocalUpdatesOptimizer(AccountedOptimizer):
    """``AccountedOptimizer`` for local updates.

    :param outer_averager_opts: ``OuterAverager``'s own arguments (outer learning rate and momentum, the plan's
      authority, the robust rule, the receipts' ``attest``)
    :param overlap: each outer round runs in the background while the next inner steps train, and is applied when
      it ends (one round late, as delayed parameter updates are for large-batch): the GPU does not wait for the
      network. Without it the peer waits for each round.

    A finished epoch claims the samples its outer round averaged in (0 when the round failed here: those samples
    are lost with the local parameters, as a failed round costs a large-batch peer its group's gradients). After a
    failed round the peer takes the newest outer state from the peers that averaged, so that its pseudo-gradients
    start again from the outer parameters everyone else holds.
    """

    def __init__(self, *args: Any, outer_averager_opts: dict, overlap: bool = False, **kwargs: Any):
        overlap = overlap and not kwargs.get("auxiliary")  # an auxiliary peer trains nothing meanwhile
        self._outer_averager_opts = dict(outer_averager_opts, overlap=overlap)
        kwargs.update(use_local_updates=True, grad_averager_factory=None, delay_grad_averaging=False,
                      delay_optimizer_step=False, delay_state_averaging=overlap, offload_optimizer=False,
                      average_state_every=1)
        super().__init__(*args, **kwargs)
        self._overlap = overlap
        self._round: Optional[_OuterRound] = None
        self._phase_seconds = 0.0
        self._catch_up_tries, self._catch_up_at = 0, 0.0
        self._phase_began = self._round_began = time.monotonic()
        # the last round's seconds over its phase's; unknown before the first round with others, which waits
        self._round_share = math.inf
        self._overlapping = False  # whether the last round overlapped the inner steps after it
        self._loads_at_round = 0  # outer states loaded before the last round

    def _make_state_averager(self, **kwargs: Any) -> OuterAverager:
        kwargs.pop("delta_rule_averaging", None)  # the outer averager applies results its own way
        return OuterAverager(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            custom_gradients=False,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **self._outer_averager_opts,
            **kwargs,
        )

    @property
    def averager(self) -> OuterAverager:
        """The averager the coordinator's plan applies to: the outer one."""
        return self.state_averager

    def step(self, *args: Any, batch_size: Any = None, **kwargs: Any):
        if not self.auxiliary:
            self.state_averager.samples += batch_size if batch_size is not None else self.batch_size_per_step
        return super().step(*args, batch_size=batch_size, **kwargs)

    def _maybe_schedule_state_averaging(self) -> None:
        """Begin the outer round's matchmaking ``matchmaking_time`` before the swarm's samples reach the outer batch,
        so that the peers train while they find each other. hivemind's own pre-scheduling waits to have measured the
        delay before a round, which it measures only for rounds it pre-scheduled: it never begins (1 s lost at every
        outer round, bench/results/local_updates.md)."""
        averager = self.state_averager
        if self.auxiliary or averager.averaging_in_progress or self.tracker.global_progress.num_peers <= 1:
            return  # hivemind makes no round where it sees no other peer
        if self.scheduled_state is not None and not (self.scheduled_state.triggered or self.scheduled_state.done()):
            return
        eta = self.tracker.estimated_next_update_time - get_dht_time()
        if eta <= self.matchmaking_time:
            least = averager.matchmaking_kwargs["min_matchmaking_time"]
            self.scheduled_state = averager.schedule_round(get_dht_time() + max(eta, least),
                                                           timeout=self.averaging_timeout)

    def _update_global_epoch(self, grad_scaler) -> None:
        averager = self.state_averager
        if self._round_running:  # overlapped: the last outer round ends, and is applied, before the next begins
            averager.step(wait_for_delayed_updates=True)
            self.collect_rounds()
        self._catch_up_tries = 0  # this round finds out whether the peer is behind
        now = time.monotonic()
        overlap = self._overlap and (self._round_share <= OVERLAP_SHARE or
                                     self._overlapping and self._round_share <= WAIT_SHARE)
        if overlap != self._overlapping and self._overlap:
            print(f"outer rounds take {self._round_share:.0%} of a phase: the next ones " +
                  ("run while this peer trains on" if overlap else "wait for their round (inner steps taken from "
                   "parameters one outer step old cost quality there)"), flush=True)
        self._overlapping = overlap
        self._phase_seconds, self._phase_began, self._round_began = now - self._phase_began, now, now
        rounds, attempts = averager.rounds, averager.attempts
        behind = self.local_epoch < self.tracker.global_epoch  # a peer moved the swarm on before this one
        # a peer that took a state from others in this phase knows it is not alone, though its tracker may not see
        # them yet (a joiner's first round): stepping alone would fork the outer parameters (``OuterAverager.lineage``)
        joined, self._loads_at_round = averager.loads > self._loads_at_round, averager.loads
        super(AccountedOptimizer, self)._update_global_epoch(grad_scaler)
        # hivemind makes no round when it sees no other peer in the swarm's epoch. The peer that moved the epoch on
        # steps alone; one behind it (which sees only that peer, already an epoch ahead) takes its outer state:
        # stepping alone too would leave the two on different outer parameters for good
        alone = averager.attempts == attempts and not self.auxiliary
        behind = behind or joined
        if alone and behind:
            averager.missed = True
        elif alone:
            averager.step_alone()
        # The epoch's claim, with the samples this peer sent; those its round averaged in are known once the round
        # has ended (``_end_round``), and replace them
        sent = 0 if alone and behind else int(averager.last_weight)
        self.finished_epochs.append(FinishedEpoch(self.local_epoch - 1, sent))
        self._round = _OuterRound(self.local_epoch - 1, rounds, alone)
        self._round_running = True
        if self._overlap and not overlap:  # a round that may not overlap runs where it would, and is waited for here
            averager.step(wait_for_delayed_updates=True)
        self.collect_rounds()  # the round is over already unless it overlaps the next inner steps

    def collect_rounds(self) -> None:
        """End the last outer round if it has ended in the background: apply it, take its receipts, and take the
        swarm's outer state if it failed here (call between mini-steps)."""
        if self._catch_up_tries and time.monotonic() >= self._catch_up_at and not self.leave.is_set():
            self._catch_up()
        if not self._round_running or self._update_pending():
            return
        self.state_averager.step(apply_delayed_updates=True)  # hivemind's next step would apply it: now
        self._end_round()

    def _end_round(self) -> None:
        averager, outer_round = self.state_averager, self._round
        if not outer_round.alone:
            self._round_share = (time.monotonic() - self._round_began) / max(self._phase_seconds, 1e-3)
        applied = averager.rounds > outer_round.rounds_before
        weight = int(averager.last_weight) if applied else 0
        self._take_receipts(samples=weight)
        if not self.client_mode:  # the freshest outer state is the one of the latest epoch
            averager.state_sharing_priority = averager.outer_epoch
        if applied:
            what = "stepped alone (no other peer in the swarm) on" if outer_round.alone else "averaged"
            print(f"outer round {outer_round.epoch}: {what} this peer's {weight:,} samples", flush=True)
        elif averager.missed and self.leave.is_set():
            # leaving (an overlapped round ends in the grace): the parameters it leaves with (--state-out) are the
            # swarm's, as a waiting peer's are, where a peer serves them before the grace ends
            averager.missed = averager.off_lineage = False
            print(f"outer round {outer_round.epoch}: it failed here; taking the newest outer state from the swarm "
                  "before leaving", flush=True)
            self._catch_up_before_leaving()
        elif averager.missed:
            why = ("its peers averaged from outer parameters other rounds made" if averager.off_lineage else
                   "its peers averaged from newer outer parameters" if averager.stale else
                   "no round formed with its peers (it saw none in its epoch)" if outer_round.alone else
                   "it failed here")
            averager.missed = averager.off_lineage = False
            print(f"outer round {outer_round.epoch}: {why}; taking the newest outer state from the swarm", flush=True)
            self._catch_up_tries = CATCH_UP_TRIES if self._overlap else 1
            self._catch_up()

    def _catch_up(self) -> None:
        """Look for a newer outer state after a missed round. Overlapped, the peers that averaged apply their round
        at their next mini-step, so the first look may find none newer yet: it looks again ``CATCH_UP_SPACING`` later,
        ``CATCH_UP_TRIES`` times in all, until this phase's round (which would find this peer stale)."""
        self._catch_up_tries -= 1
        loads = self.state_averager.loads
        self.load_state_from_peers()
        if self.state_averager.loads > loads:
            self._catch_up_tries = 0
        elif self._catch_up_tries:
            self._catch_up_at = time.monotonic() + CATCH_UP_SPACING
        else:  # every peer missed it: they still share the outer parameters
            print("no newer outer state in the swarm: training on from this peer's", flush=True)

    def _catch_up_before_leaving(self) -> None:
        """``_catch_up`` within what is left of the leaving grace: the peers that averaged apply their round a
        moment after it ends, so it looks again ``CATCH_UP_SPACING`` later while the grace lasts."""
        loads = self.state_averager.loads
        while True:
            self.load_state_from_peers()
            if self.state_averager.loads > loads or self._grace_left() < CATCH_UP_SPACING:
                break
            time.sleep(CATCH_UP_SPACING)
        if self.state_averager.loads == loads:
            print("no newer outer state in the swarm: leaving with this peer's", flush=True)

    def load_state_from_peers(self, **kwargs: Any) -> None:
        averager, loads, epoch = self.state_averager, self.state_averager.loads, self.local_epoch
        super().load_state_from_peers(**kwargs)
        # hivemind moves a peer one epoch behind the swarm's on to it ("catching up"): with local updates that would
        # skip the round this state's peers are in, and every later round would start from older outer parameters
        # than theirs. It stays on the state's epoch (or its own, never going back), so its next round is theirs.
        averager.local_epoch = max(epoch, averager.outer_epoch)
        self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
        if averager.loads > loads:
            if not self.client_mode:
                averager.state_sharing_priority = averager.outer_epoch
            print(f"took the swarm's outer state: epoch {self.local_epoch}, {self.state_averager.rounds} outer "
                  "rounds", flush=True)
