"""Adaptive averaging: a linear program chooses which share of the vector each peer aggregates.

Round model (butterfly, i.e. partitioned all-reduce, as hivemind runs it), for a vector of V bytes: a sender i
with share s_i moves (1 + (n_s - 2) s_i) V bytes each way, an auxiliary peer n_s s_j V; both directions run at
once, so a peer needs max(up / u, down / d) seconds and the round lasts as long as its slowest peer. With fitted
``RoundCosts``, each byte also costs ``part_seconds / part_bytes`` in its direction and every round a fixed
``latency_seconds`` (docs/averaging.md#fitted-round-model); the lower bounds stay those of bandwidth alone.

Hold-back (hivemind 1.1.12, docs/averaging.md#hold-back): a zero-share sender needs up / u + down / d seconds; the
planner keeps every other sender off it with a floor share (``HOLD_BACK_FLOOR / n_s``). ``hold_back=False`` models
a runner without it.

The LP has one variable per peer that may aggregate, plus the round time T, and two rows per such peer; client-mode
peers' fixed time is added afterwards. Its size is O(n). Details: docs/averaging.md#round-model and
docs/averaging.md#planner-lp.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
from scipy import optimize, sparse

from app.planner.model import BANDWIDTH_ONLY, PeerProfile, Plan, PlanningError, RoundCosts

HOLD_BACK_FLOOR = 1e-3
"""Share of the vector spread as a floor over the senders: each non-client sender aggregates at least this / n_s."""

HIVEMIND_DECIMALS = 9  # hivemind rounds its LP's shares to this many decimals (LOAD_BALANCING_LP_DECIMALS)
SHARE_SUM_TOLERANCE = 1e-6


class _Swarm:
    """The peers of one round as numpy arrays, so that the time model and the LPs are vectorised."""

    def __init__(self, peers: Iterable[PeerProfile], vector_bytes: float, costs: RoundCosts = BANDWIDTH_ONLY
                 ) -> None:
        self.peers = list(peers)
        self.ids = [p.peer for p in self.peers]
        if not self.peers:
            raise PlanningError("no peers to plan for")
        if len(set(self.ids)) != len(self.ids):
            raise PlanningError("peer ids must be unique")
        if not (math.isfinite(vector_bytes) and vector_bytes > 0):
            raise PlanningError(f"vector_bytes must be a positive number of bytes, got {vector_bytes}")
        self.vector_bytes = float(vector_bytes)
        # The links as measured (the lower bounds), and as the round model sees them: slower by the per-part cost.
        self.link_up = np.array([p.upload_bps for p in self.peers], dtype=float)
        self.link_down = np.array([p.download_bps for p in self.peers], dtype=float)
        self.up = 1.0 / (1.0 / self.link_up + costs.seconds_per_byte)
        self.down = 1.0 / (1.0 / self.link_down + costs.seconds_per_byte)
        self.latency = costs.latency_seconds
        self.reduce = np.array([p.reduce_bps for p in self.peers], dtype=float)
        self.sends = np.array([p.sends for p in self.peers], dtype=bool)
        self.aggregates = np.array([p.can_aggregate for p in self.peers], dtype=bool)
        self.n_senders = int(self.sends.sum())
        if not self.aggregates.any():
            raise PlanningError("every peer is in client mode: at least one must accept incoming connections")

    def share_load(self) -> np.ndarray:
        """Bytes each direction carries per unit of share, in units of V (n_s - 2 for senders, n_s for aux)."""
        return np.where(self.sends, self.n_senders - 2, self.n_senders).astype(float)

    def seconds(self, shares: np.ndarray, hold_back: bool) -> float:
        """Modelled seconds for one round under ``shares`` (aligned with ``self.peers``)."""
        if self.n_senders == 0:
            return 0.0  # nothing to average: hivemind finishes at once when all peers are auxiliary
        traffic = self.vector_bytes * (self.sends + self.share_load() * shares)
        up, down = traffic / self.up, traffic / self.down
        held = hold_back & self.sends & (shares == 0)
        return self.latency + float(np.where(held, up + down, np.maximum(up, down)).max())

    def share_vector(self, shares: Mapping[str, float]) -> np.ndarray:
        """Shares aligned with ``self.peers``; peers missing from the mapping get zero."""
        unknown = set(shares) - set(self.ids)
        if unknown:
            raise PlanningError(f"shares name peers that are not in the round: {sorted(unknown)}")
        vector = np.array([float(shares.get(peer, 0.0)) for peer in self.ids])
        if (vector < 0).any() or abs(vector.sum() - 1.0) > SHARE_SUM_TOLERANCE:
            raise PlanningError("shares must be non-negative and sum to 1")
        if (vector[~self.aggregates] > 0).any():
            raise PlanningError("a client-mode peer cannot aggregate: its share must be zero")
        return vector

    def shares_dict(self, vector: np.ndarray) -> dict[str, float]:
        return dict(zip(self.ids, vector.tolist()))


def plan_averaging(
    peers: Iterable[PeerProfile], vector_bytes: float, *, min_share: float | None = None, hold_back: bool = True,
    costs: RoundCosts = BANDWIDTH_ONLY,
) -> Plan:
    """Choose the share of the vector each peer aggregates so that one averaging round is as short as possible.

    :param peers: the peers of the round
    :param vector_bytes: size of the vector every sender contributes, bytes
    :param min_share: floor share of every non-client sender (fraction of the vector); by default
      ``HOLD_BACK_FLOOR / n_s`` with hold-back and 0 without
    :param hold_back: model hivemind 1.1.12's hold-back of results for zero-share peers
    :param costs: what a round costs besides bandwidth (fitted from measured rounds); bandwidth alone by default
    :returns: the plan; its predicted and lower-bound times are seconds per round
    """
    swarm = _Swarm(peers, vector_bytes, costs)
    if swarm.n_senders == 0:
        equal = swarm.aggregates / swarm.aggregates.sum()
        return Plan(shares=swarm.shares_dict(equal), predicted_seconds=0.0, lower_bound_seconds=0.0)
    shares = _solve_shares(swarm, _floor_share(swarm, min_share, hold_back), hold_back)
    return Plan(
        shares=swarm.shares_dict(shares),
        predicted_seconds=swarm.seconds(shares, hold_back),
        lower_bound_seconds=_lower_bound(swarm, hold_back),
    )


def _floor_share(swarm: _Swarm, min_share: float | None, hold_back: bool) -> float:
    if min_share is None:
        return HOLD_BACK_FLOOR / swarm.n_senders if hold_back else 0.0
    limit = 1.0 / max(int((swarm.sends & swarm.aggregates).sum()), 1)  # the floors alone must fit in the vector
    # a zero floor under hold-back would let the LP pick zero shares whose sequential cost it does not model
    if not (0.0 <= min_share <= limit) or (hold_back and min_share == 0.0):
        raise PlanningError(f"min_share must be in (0, {limit:g}] (or 0 without hold-back), got {min_share}")
    return float(min_share)


def _solve_shares(swarm: _Swarm, floor: float, hold_back: bool) -> np.ndarray:
    """Solve the planner's LP; returns shares aligned with ``swarm.peers``."""
    idx = np.flatnonzero(swarm.aggregates)
    size = idx.size
    # Time is measured in units of the fastest link moving V bytes, so that coefficients are near 1 whatever the
    # units and sizes: highs' absolute tolerances then mean the same thing for 10 kB and 10 GB vectors.
    unit = swarm.vector_bytes / max(swarm.up.max(), swarm.down.max())
    per_up, per_down = swarm.vector_bytes / swarm.up[idx] / unit, swarm.vector_bytes / swarm.down[idx] / unit
    load, base = swarm.share_load()[idx], swarm.sends[idx].astype(float)
    a_ub = sparse.hstack(
        [sparse.vstack([sparse.diags(per_up * load), sparse.diags(per_down * load)]), -np.ones((2 * size, 1))]
    )
    b_ub = -np.concatenate([per_up * base, per_down * base])
    lower = np.where(swarm.sends[idx], floor, 0.0)
    # Client-mode peers' time does not depend on the shares, so it stays out of the LP: as a floor under T it let
    # highs return a lopsided vertex (docs/averaging.md#planner-lp). The round time is still the max over all peers.
    bounds = [(low, 1.0) for low in lower] + [(0.0, None)]
    cost = np.zeros(size + 1)
    cost[-1] = 1.0  # minimise T
    a_eq = np.concatenate([np.ones(size), [0.0]])[None, :]
    result = optimize.linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=[1.0], bounds=bounds, method="highs")
    if result.status != 0:
        raise PlanningError(f"the averaging LP has no solution: {result.message}")
    shares = np.zeros(len(swarm.peers))
    shares[idx] = np.clip(result.x[:size], lower, 1.0)  # highs may overstep bounds by its tolerance
    return shares / shares.sum()


def round_seconds(
    peers: Iterable[PeerProfile], shares: Mapping[str, float], vector_bytes: float, *, hold_back: bool = True,
    costs: RoundCosts = BANDWIDTH_ONLY,
) -> float:
    """Modelled seconds for one averaging round of ``vector_bytes`` bytes under ``shares`` (see module doc).

    Peers missing from ``shares`` get share zero, as a peer that joined after the plan was made would.
    """
    swarm = _Swarm(peers, vector_bytes, costs)
    return swarm.seconds(swarm.share_vector(shares), hold_back)


def lower_bound_seconds(peers: Iterable[PeerProfile], vector_bytes: float, *, hold_back: bool = True) -> float:
    """Seconds no averaging round of these peers can beat (docs/benchmarks.md#lower-bounds), adapted to aux and
    client peers.

    ``max(V / min u_i, V / min d_i, 2 (n_s - 1) V / sum u_j, 2 (n_s - 1) V / sum d_j)``, where the minima run over
    the n_s senders (each moves at least V each way when n_s >= 2) and the sums over every peer that can carry
    traffic (senders and aggregating aux peers), since a round moves at least 2 (n_s - 1) V bytes each way.
    A client-mode sender never aggregates, so it moves exactly V each way, in sequence under hold-back:
    ``V / u_i + V / d_i`` (``max`` of the two without hold-back); and the rest of the volume, ``2 (n_s - 1) V - c V``
    for c client-mode senders, falls on the peers that aggregate.
    """
    return _lower_bound(_Swarm(peers, vector_bytes), hold_back)


def _lower_bound(swarm: _Swarm, hold_back: bool) -> float:
    bounds = [0.0]
    up, down = swarm.link_up, swarm.link_down  # bandwidth alone: a bound, whatever the fitted costs
    clients = swarm.sends & ~swarm.aggregates
    if clients.any():
        alone_up, alone_down = swarm.vector_bytes / up[clients], swarm.vector_bytes / down[clients]
        bounds.append(float((alone_up + alone_down if hold_back else np.maximum(alone_up, alone_down)).max()))
    if swarm.n_senders >= 2:
        volume, carriers = swarm.vector_bytes, swarm.sends | swarm.aggregates
        total = 2 * (swarm.n_senders - 1) * volume
        bounds += [volume / up[swarm.sends].min(), volume / down[swarm.sends].min()]
        bounds += [total / up[carriers].sum(), total / down[carriers].sum()]
        if clients.any() and swarm.aggregates.any():
            rest = total - int(clients.sum()) * volume
            bounds += [rest / up[swarm.aggregates].sum(), rest / down[swarm.aggregates].sum()]
    return float(max(bounds))


def ring_allreduce_seconds(peers: Iterable[PeerProfile], vector_bytes: float) -> float:
    """Ring all-reduce over the senders, paced by the slowest link: ``2 (n_s - 1) / n_s * V / min_i min(u_i, d_i)``.

    Aux peers hold no vector and sit out. A client-mode peer can sit in the ring only between two peers that
    accept connections, so a ring with more client-mode senders than other senders is impossible: ``math.inf``.
    """
    swarm = _Swarm(peers, vector_bytes)
    senders = swarm.sends
    if swarm.n_senders < 2:
        return 0.0
    clients = int((senders & ~swarm.aggregates).sum())
    if clients > swarm.n_senders - clients:
        return math.inf
    slowest = min(swarm.up[senders].min(), swarm.down[senders].min())
    return 2 * (swarm.n_senders - 1) / swarm.n_senders * swarm.vector_bytes / slowest


def parameter_server_seconds(peers: Iterable[PeerProfile], vector_bytes: float, *, hold_back: bool = True) -> float:
    """One peer aggregates the whole vector (the best such peer for these links); the others push and pull.

    Under hold-back every other sender pushes, then pulls, as in a classic synchronous parameter server.
    """
    swarm = _Swarm(peers, vector_bytes)
    times = []
    for server in np.flatnonzero(swarm.aggregates):
        shares = np.zeros(len(swarm.peers))
        shares[server] = 1.0
        times.append(swarm.seconds(shares, hold_back))
    return min(times)


def byteps_seconds(peers: Iterable[PeerProfile], vector_bytes: float, *, hold_back: bool = True) -> float:
    """BytePS-like: the aux peers (CPU servers) split the vector equally and the workers aggregate nothing.

    Without aux peers BytePS puts a server beside every worker: an equal split over the peers that can aggregate.
    Run by hivemind (``hold_back=True``) the zero-share workers push, then pull; BytePS itself pipelines push and
    pull per partition, which ``hold_back=False`` models.
    """
    swarm = _Swarm(peers, vector_bytes)
    servers = swarm.aggregates & ~swarm.sends
    if not servers.any():
        servers = swarm.aggregates
    return swarm.seconds(servers / servers.sum(), hold_back)


def equal_split_seconds(peers: Iterable[PeerProfile], vector_bytes: float, *, hold_back: bool = True) -> float:
    """Every peer that can aggregate (aux peers included) takes the same share."""
    swarm = _Swarm(peers, vector_bytes)
    return swarm.seconds(swarm.aggregates / swarm.aggregates.sum(), hold_back)


def hivemind_shares(peers: Iterable[PeerProfile]) -> dict[str, float]:
    """hivemind's own split (``hivemind.averaging.load_balancing.load_balance_peers``), solved with highs.

    It minimises ``max_i (1 + (g - 2) w_i) / b_i`` over the peers with a non-zero bandwidth, where g counts every
    peer of the group and b_i is the single bandwidth a peer announces; here ``b_i = min(u_i, d_i)``, its binding
    direction. Client-mode peers announce 0 and get nothing. The rule ignores hold-back and aux peers' load, which
    is why it gives slow peers exactly zero and loses to an equal split on mixed links.
    """
    swarm = _Swarm(peers, 1.0)
    idx = np.flatnonzero(swarm.aggregates)
    bandwidth = np.minimum(swarm.up[idx], swarm.down[idx])
    bandwidth = bandwidth / bandwidth.max()  # the rule is scale-free; near-1 numbers suit highs' tolerances
    group = len(swarm.peers)
    a_ub = sparse.hstack([sparse.diags((group - 2.0) / bandwidth), -np.ones((idx.size, 1))])
    cost = np.zeros(idx.size + 1)
    cost[-1] = 1.0
    a_eq = np.concatenate([np.ones(idx.size), [0.0]])[None, :]
    bounds = [(0.0, 1.0)] * idx.size + [(None, None)]
    result = optimize.linprog(
        cost, A_ub=a_ub, b_ub=-1.0 / bandwidth, A_eq=a_eq, b_eq=[1.0], bounds=bounds, method="highs"
    )
    if result.status != 0:
        raise PlanningError(f"hivemind's load-balancing LP has no solution: {result.message}")
    shares = np.zeros(group)
    shares[idx] = _spread_over_optimal_face(result.x[-1], bandwidth, group)
    return swarm.shares_dict(shares / shares.sum())


def _spread_over_optimal_face(optimum: float, bandwidth: np.ndarray, group: int) -> np.ndarray:
    """Among the tied optima of hivemind's LP, shares proportional to each peer's headroom at the optimum.

    hivemind solved its LP with scipy's old interior-point method, which lands inside the optimal face, not on a
    vertex: every peer with headroom gets some share and only the peers the optimum pins at zero get none.
    highs returns a vertex, which would starve (and so hold back) peers hivemind would not; spreading the vector
    by headroom keeps hivemind's choice of which peers get zero.
    """
    if group <= 2:
        headroom = np.ones_like(bandwidth)  # with two peers the shares change nobody's load
    else:
        headroom = np.clip((optimum * bandwidth - 1.0) / (group - 2.0), 0.0, 1.0)
    return np.round(headroom / headroom.sum(), HIVEMIND_DECIMALS)


def hivemind_split_seconds(peers: Iterable[PeerProfile], vector_bytes: float, *, hold_back: bool = True) -> float:
    """Modelled seconds per round under hivemind's own bandwidth-only split (see ``hivemind_shares``)."""
    peers = list(peers)
    return round_seconds(peers, hivemind_shares(peers), vector_bytes, hold_back=hold_back)
