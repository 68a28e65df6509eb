"""The planner's objective is the whole optimizer step (DeDLOC, section 3.2): accumulating the global batch plus
averaging it, in groups of at most ``group_size`` peers.

Step model, for a global batch of B samples and peers that train at c_i samples per second (C = sum c_i):

- blocking (no delayed parameter updates): ``step = B / C + T``, T the averaging round (its slowest group's);
  aggregating costs no training, as training waits for the round;
- overlapped (delayed parameter updates): the round runs during the next accumulation, so
  ``step = max(T, (B + L) / C)``, where ``L = sum_j w_j * c_j * k_j * V * s_j / r_j`` are the samples the
  aggregators' training loses: aggregating competes with computing for a peer's resources, as in the paper's
  model, by the fraction ``w_j`` of its reduce seconds that its training loses (``PeerProfile.reduce_costs_training``:
  1 for a CPU peer, a part for a GPU peer). So the LP hands aggregation to the peers whose compute is worth least,
  where the links allow: with equal links, the slower trainer aggregates (docs/averaging.md#step).

In both, a peer that reduces at r_j bytes per second needs ``k_j * V * s_j / r_j`` seconds for its share (k_j: the
parts it receives, n_s - 1 for a sender, n_s for an auxiliary peer), which bounds the round like its links do. The round
model of each group is ``app.planner.lp``'s.

Groups: ``partition_groups`` deals the peers into ceil(n / m) groups so that each has peers that may aggregate and
fast and slow links alike (the round lasts as long as the slowest group). The LP has the shares of every peer that
may aggregate, one round time T_g per group and the step time tau; it minimises ``tau + EPSILON * mean(T_g)``, so
that groups which do not set the step are still solved to their own optimum. Its size is O(n); the planner's time
for 1,000 peers is in bench/results/averaging_groups.md. Design: docs/averaging.md#groups and #step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, sparse

from app.planner.lp import _floor_share, _lower_bound, _Swarm
from app.planner.model import BANDWIDTH_ONLY, PeerProfile, Plan, PlanningError, RoundCosts

EPSILON = 1e-3  # weight of the groups' own round times next to the step time in the objective


@dataclass(frozen=True)
class StepOptions:
    """What the step model needs besides the peers.

    :param target_batch_size: samples per optimizer step, collaboration-wide
    :param overlap: delayed parameter updates: averaging runs during the next accumulation
    :param group_size: at most this many peers average together (at least 3: with 2, an odd swarm leaves a peer
      alone); None: one group of every peer
    """

    target_batch_size: int
    overlap: bool = False
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.target_batch_size <= 0:
            raise PlanningError(f"target_batch_size must be a positive number of samples, got {self.target_batch_size}")
        if self.group_size is not None and self.group_size < 3:
            raise PlanningError(f"group_size must be at least 3 peers, got {self.group_size}")


def partition_groups(peers: Iterable[PeerProfile], group_size: int | None) -> list[list[PeerProfile]]:
    """The peers dealt into ceil(n / group_size) groups whose sizes differ by at most one (so at least 2 each, for a
    group size of 3 or more).

    Peers are dealt in snake order (0, 1, ..., G-1, G-1, ..., 0, ...): first the senders that may aggregate, then the
    auxiliary peers, then the client-mode peers, each kind fastest link first; so every group gets a peer that may
    aggregate, and a like mix of fast and slow links.
    """
    peers = list(peers)
    if group_size is None or len(peers) <= group_size:
        return [peers]
    count = math.ceil(len(peers) / group_size)
    aggregators = sum(p.can_aggregate for p in peers)
    if aggregators < count:
        raise PlanningError(f"{count} groups of at most {group_size} peers need {count} peers that accept "
                            f"connections; {aggregators} do")

    def order(p: PeerProfile) -> tuple:
        kind = 0 if p.sends and p.can_aggregate else 1 if p.can_aggregate else 2
        return kind, -min(p.upload_bps, p.download_bps), p.peer

    groups: list[list[PeerProfile]] = [[] for _ in range(count)]
    for index, p in enumerate(sorted(peers, key=order)):
        lap, position = divmod(index, count)
        groups[position if lap % 2 == 0 else count - 1 - position].append(p)
    return groups


def plan_step(
    peers: Iterable[PeerProfile],
    vector_bytes: float,
    options: StepOptions,
    *,
    min_share: Callable[[list[PeerProfile]], float | None] = lambda peers: None,
    hold_back: bool = False,
    costs: RoundCosts = BANDWIDTH_ONLY,
) -> Plan:
    """Groups and shares that make one optimizer step as short as possible (see the module doc).

    :param peers: every peer of the swarm
    :param vector_bytes: size of the vector every sender contributes, bytes
    :param min_share: the floor share of every sender for a group's peers (``plan_averaging``'s ``min_share``)
    :param hold_back: model hivemind 1.1.12's hold-back of results for zero-share peers (planned groups stream)
    :param costs: what a round costs besides bandwidth (``app.planner.lp``'s round model)
    :returns: the plan; ``predicted_seconds`` is the round (slowest group), ``step_seconds`` the whole step
    """
    peers = list(peers)
    _Swarm(peers, vector_bytes)  # the same checks as plan_averaging: ids, vector, someone who may aggregate
    swarms = [_Swarm(group, vector_bytes, costs) for group in partition_groups(peers, options.group_size)]
    floors = [_floor_share(s, min_share(s.peers), hold_back) if s.n_senders else 0.0 for s in swarms]
    shares = _solve(swarms, floors, vector_bytes, options, hold_back)
    return _plan_of(swarms, shares, floors, options, hold_back)


def plan_cost(peers: Iterable[PeerProfile], plan: Plan, vector_bytes: float, options: StepOptions,
              *, hold_back: bool = False, costs: RoundCosts = BANDWIDTH_ONLY) -> float:
    """Modelled seconds per step (per round where compute is unknown) of ``plan``'s groups and shares on ``peers``.

    Groups keep the plan's membership among the peers present; peers the plan does not name raise PlanningError.
    """
    costed = _costed(peers, plan, vector_bytes, options, hold_back, costs)
    return costed.step_seconds if costed.step_seconds is not None else costed.predicted_seconds


def plan_round_seconds(peers: Iterable[PeerProfile], plan: Plan, vector_bytes: float, *, hold_back: bool = False,
                       costs: RoundCosts = BANDWIDTH_ONLY) -> float:
    """Modelled seconds of one averaging round (its slowest group's) of ``plan`` on ``peers``, as ``plan_cost``
    takes them."""
    return _costed(peers, plan, vector_bytes, StepOptions(target_batch_size=1), hold_back, costs).predicted_seconds


def _costed(peers: Iterable[PeerProfile], plan: Plan, vector_bytes: float, options: StepOptions, hold_back: bool,
            costs: RoundCosts) -> Plan:
    by_id = {p.peer: p for p in peers}
    named = plan.groups or (tuple(plan.shares),)
    groups = [[by_id[peer] for peer in group if peer in by_id] for group in named]
    if sum(map(len, groups)) != len(by_id):
        raise PlanningError("the plan does not name every peer present")
    if not by_id:  # every peer it named left (a soak run's coordinator died of it, fitting a round time)
        raise PlanningError("no peer the plan names is present")
    swarms = [_Swarm(group, vector_bytes, costs) for group in groups if group]
    shares = []
    for swarm in swarms:
        vector = np.array([plan.shares.get(peer, 0.0) for peer in swarm.ids])
        total = vector[swarm.aggregates].sum()
        shares.append(vector / total if total > 0 else swarm.aggregates / swarm.aggregates.sum())
    return _plan_of(swarms, shares, [0.0] * len(swarms), options, hold_back)


def _reduce_load(swarm: _Swarm) -> np.ndarray:
    """Parts a peer reduces per unit of share, in units of V: one from every other sender (n_s for aux peers)."""
    return np.where(swarm.sends, swarm.n_senders - 1, swarm.n_senders).astype(float)


def _lost_samples_per_share(swarm: _Swarm) -> np.ndarray:
    """Samples each peer loses per unit of share it aggregates, when that overlaps its training: its compute times
    the part of its reduce seconds that its training loses."""
    costs = np.array([float(p.reduce_costs_training) for p in swarm.peers])
    compute = np.array([p.samples_per_second for p in swarm.peers])
    seconds = np.where(np.isfinite(swarm.reduce), _reduce_load(swarm) * swarm.vector_bytes / swarm.reduce, 0.0)
    return compute * costs * seconds


def _solve(swarms: Sequence[_Swarm], floors: Sequence[float], vector_bytes: float, options: StepOptions,
           hold_back: bool) -> list[np.ndarray]:
    """Solve the step LP; returns each group's shares aligned with its peers."""
    fastest = max(max(s.up.max(), s.down.max()) for s in swarms)
    unit = vector_bytes / fastest  # times in units of the fastest link moving V bytes: coefficients near 1
    solved = [s for s in swarms if s.n_senders]
    sizes = [int(s.aggregates.sum()) for s in solved]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    n_shares, n_groups = int(offsets[-1]), len(solved)
    tau = n_shares + n_groups
    blocks, b_ub, lower = [], [], []
    for g, (swarm, floor) in enumerate(zip(solved, _solved_floors(swarms, floors))):
        idx = np.flatnonzero(swarm.aggregates)
        load, base = swarm.share_load()[idx], swarm.sends[idx].astype(float)
        per_byte = [vector_bytes / swarm.up[idx], vector_bytes / swarm.down[idx]]
        finite = np.isfinite(swarm.reduce[idx])
        per_byte.append(np.where(finite, vector_bytes / swarm.reduce[idx], 0.0))
        for k, seconds in enumerate(per_byte):
            rows = sparse.coo_matrix(sparse.diags(seconds / unit * (load if k < 2 else _reduce_load(swarm)[idx])))
            blocks.append((rows.row, offsets[g] + rows.col, rows.data, len(idx), n_shares + g))
            # a round's fixed latency is under T_g too (the reducer's CPU runs within the round's time)
            b_ub.append(-(seconds / unit * base + swarm.latency / unit) if k < 2 else np.zeros(len(idx)))
        lower.append(np.where(swarm.sends[idx], floor, 0.0))
    rows, cols, data, row = [], [], [], 0
    for r, c, d, count, group_column in blocks:
        rows += [r + row, np.arange(count) + row]
        cols += [c, np.full(count, group_column)]
        data += [d, -np.ones(count)]
        row += count
    for g in range(n_groups):  # T_g <= tau
        rows += [np.array([row, row])]
        cols += [np.array([n_shares + g, tau])]
        data += [np.array([1.0, -1.0])]
        b_ub.append(np.zeros(1))
        row += 1
    compute = sum(p.samples_per_second for s in swarms for p in s.peers)
    if options.overlap and compute > 0:  # (B + lost) / C <= tau, in units of B
        lost = np.concatenate([_lost_samples_per_share(s)[s.aggregates] for s in solved])
        rows += [np.full(n_shares + 1, row)]
        cols += [np.concatenate([np.arange(n_shares), [tau]])]
        data += [np.concatenate([lost / options.target_batch_size, [-compute * unit / options.target_batch_size]])]
        b_ub.append(np.array([-1.0]))
        row += 1
    a_ub = sparse.csr_matrix((np.concatenate(data), (np.concatenate(rows), np.concatenate(cols))),
                             shape=(row, tau + 1))
    a_eq = sparse.csr_matrix((np.ones(n_shares), (np.repeat(np.arange(n_groups), sizes), np.arange(n_shares))),
                             shape=(n_groups, tau + 1))
    low = np.concatenate(lower) if lower else np.zeros(0)
    bounds = [(x, 1.0) for x in low] + [(0.0, None)] * (n_groups + 1)
    cost = np.zeros(tau + 1)
    cost[n_shares:tau] = EPSILON / max(n_groups, 1)
    cost[tau] = 1.0
    result = optimize.linprog(cost, A_ub=a_ub, b_ub=np.concatenate(b_ub), A_eq=a_eq, b_eq=np.ones(n_groups),
                              bounds=bounds, method="highs")
    if result.status != 0:
        raise PlanningError(f"the step LP has no solution: {result.message}")
    shares, solved_index = [], 0
    for swarm in swarms:
        vector = np.zeros(len(swarm.peers))
        if swarm.n_senders:
            g = solved_index
            idx = np.flatnonzero(swarm.aggregates)
            vector[idx] = np.clip(result.x[offsets[g]:offsets[g + 1]], lower[g], 1.0)  # highs' tolerance
            solved_index += 1
        else:  # nothing to average: the auxiliary peers split nothing equally
            vector = swarm.aggregates / swarm.aggregates.sum()
        shares.append(vector / vector.sum())
    return shares


def _solved_floors(swarms: Sequence[_Swarm], floors: Sequence[float]) -> list[float]:
    """The floors of the groups that have something to average, in order."""
    return [floor for swarm, floor in zip(swarms, floors) if swarm.n_senders]


def _plan_of(swarms: Sequence[_Swarm], shares: Sequence[np.ndarray], floors: Sequence[float],
             options: StepOptions, hold_back: bool) -> Plan:
    """The plan's times and roles for given shares per group."""
    rounds = [max(s.seconds(v, hold_back), _reduce_seconds(s, v)) for s, v in zip(swarms, shares)]
    round_time = max(rounds)
    compute = sum(p.samples_per_second for s in swarms for p in s.peers)
    accumulate = step = None
    if compute > 0:
        accumulate = options.target_batch_size / compute
        if options.overlap:
            lost = sum(float(_lost_samples_per_share(s) @ v) for s, v in zip(swarms, shares))
            step = max(round_time, (options.target_batch_size + lost) / compute)
        else:
            step = accumulate + round_time
    plan_shares: dict[str, float] = {}
    roles: dict[str, str] = {}
    for swarm, vector, floor in zip(swarms, shares, floors):
        plan_shares.update(swarm.shares_dict(vector))
        for p, share in zip(swarm.peers, vector.tolist()):
            aggregates = share > floor * (1 + 1e-6) + 1e-9
            roles[p.peer] = (("compute+aggregate" if aggregates else "compute") if p.sends
                             else "aggregate" if share > 0 else "idle")
    return Plan(
        shares=plan_shares,
        predicted_seconds=round_time,
        lower_bound_seconds=max(_lower_bound(s, hold_back) for s in swarms),
        groups=tuple(tuple(s.ids) for s in swarms) if len(swarms) > 1 else (),
        accumulate_seconds=accumulate,
        step_seconds=step,
        roles=roles,
    )


def _reduce_seconds(swarm: _Swarm, shares: np.ndarray) -> float:
    """Seconds the slowest reducer of the group needs for its share of the parts."""
    if swarm.n_senders == 0:
        return 0.0
    return float((_reduce_load(swarm) * swarm.vector_bytes * shares / swarm.reduce).max())
