"""What the averaging planner reads and writes: peer profiles in, a plan out.

Units throughout the planner: bandwidths in bytes per second (not bits), vector sizes in bytes, times in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from app.core.errors import Invalid

ROLES = ("compute+aggregate", "compute", "aggregate", "idle")
"""What a peer does in a step: trains and aggregates more than the floor share, only trains (its share is the floor
or zero), only aggregates (an auxiliary peer with a share), or nothing (an auxiliary peer the plan leaves out)."""


class PlanningError(Invalid):
    """The peers given cannot form an averaging round, or a plan does not fit them."""


@dataclass(frozen=True)
class PeerProfile:
    """One peer as the planner sees it (measured by the coordinator, or announced by the peer).

    :param peer: unique peer identifier (the libp2p PeerID in base58)
    :param samples_per_second: training throughput, samples per second; 0 for peers that do not train. The time
      of one averaging round does not depend on it; the step's does, and so, under delayed parameter updates, does
      what aggregating a share costs the peer's training (``reduce_costs_training``)
    :param upload_bps: upload bandwidth, bytes per second
    :param download_bps: download bandwidth, bytes per second
    :param client_mode: the peer cannot accept incoming connections (behind NAT): it sends and receives, but
      never aggregates, so its share is always zero
    :param aux: auxiliary peer: contributes no vector of its own, but may aggregate (a CPU server)
    :param reduce_bps: bytes per second of incoming parts the peer can aggregate (its CPU's rate, serialization
      included); ``math.inf`` where aggregating is never what limits it
    :param reduce_costs_training: the fraction of each second the peer spends aggregating during the next
      accumulation (delayed parameter updates) that its training loses, in [0, 1]: 1 for a peer that aggregates on
      the cores it trains on (a CPU peer), a part for a GPU peer whose host feeds its GPU, 0 where aggregating never
      slows training (``True``/``False`` read as 1/0)
    """

    peer: str
    samples_per_second: float
    upload_bps: float
    download_bps: float
    client_mode: bool = False
    aux: bool = False
    reduce_bps: float = math.inf
    reduce_costs_training: float = 0.0

    def __post_init__(self) -> None:
        if not self.peer:
            raise PlanningError("a peer profile needs a non-empty peer id")
        for name in ("upload_bps", "download_bps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise PlanningError(f"peer {self.peer}: {name} must be a positive number of bytes/s, got {value}")
        if not (math.isfinite(self.samples_per_second) and self.samples_per_second >= 0):
            raise PlanningError(f"peer {self.peer}: samples_per_second must be >= 0, got {self.samples_per_second}")
        if not (self.reduce_bps > 0):  # inf is allowed: aggregating never limits the peer
            raise PlanningError(f"peer {self.peer}: reduce_bps must be a positive number of bytes/s, got "
                                f"{self.reduce_bps}")
        if not 0.0 <= self.reduce_costs_training <= 1.0:
            raise PlanningError(f"peer {self.peer}: reduce_costs_training is a fraction in [0, 1], got "
                                f"{self.reduce_costs_training}")

    @property
    def sends(self) -> bool:
        """Whether the peer contributes a vector to the average (every peer but an auxiliary one)."""
        return not self.aux

    @property
    def can_aggregate(self) -> bool:
        """Whether the peer may be given a non-zero share (it must accept incoming connections)."""
        return not self.client_mode


@dataclass(frozen=True)
class RoundCosts:
    """What a round costs besides moving bytes over the links, fitted from the rounds a swarm measured
    (``app.planner.fit``; docs/averaging.md#fitted-round-model).

    :param latency_seconds: seconds every round takes whatever its size (the group's first messages, the last
      result's way back, waits on stragglers)
    :param part_seconds: seconds each part of ``part_bytes`` costs the peer that sends or receives it (serializing,
      one RPC message), in each direction, on top of its link time
    :param part_bytes: bytes per part, as the averager splits the vector
    :param rounds: how many measured rounds the figures were fitted from (0: not fitted, both costs 0)
    """

    latency_seconds: float = 0.0
    part_seconds: float = 0.0
    part_bytes: float = 2.0**17
    rounds: int = 0

    def __post_init__(self) -> None:
        for name in ("latency_seconds", "part_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise PlanningError(f"{name} must be >= 0 seconds, got {value}")
        if not (math.isfinite(self.part_bytes) and self.part_bytes > 0):
            raise PlanningError(f"part_bytes must be a positive number of bytes, got {self.part_bytes}")

    @property
    def seconds_per_byte(self) -> float:
        """The per-part cost spread over the part's bytes: what each byte adds to a direction's link time."""
        return self.part_seconds / self.part_bytes


BANDWIDTH_ONLY = RoundCosts()
"""The round model of bandwidth alone: what a round costs before any round was measured."""


@dataclass(frozen=True)
class Plan:
    """Who aggregates which share of the vector, and what the round is expected to cost.

    :param shares: fraction of the vector each peer aggregates, by peer id; every peer of the round is named,
      shares are >= 0 and sum to 1
    :param predicted_seconds: modelled duration of one averaging round under these shares, seconds
    :param lower_bound_seconds: bandwidth lower bound for the same peers and vector, seconds
    :param groups: the averaging groups the plan was solved for, peer ids per group (``plan_step``); empty: one
      group of every peer. Shares sum to 1 within each group.
    :param accumulate_seconds: modelled seconds for the swarm to accumulate the global batch (``plan_step``, where
      the peers' compute is known), None otherwise
    :param step_seconds: modelled seconds per optimizer step, accumulation plus averaging (overlapped under delayed
      parameter updates), None where compute is unknown
    :param roles: each peer's role as the solution gives it (``ROLES``); empty for ``plan_averaging``
    """

    shares: dict[str, float]
    predicted_seconds: float
    lower_bound_seconds: float
    groups: tuple[tuple[str, ...], ...] = ()
    accumulate_seconds: float | None = None
    step_seconds: float | None = None
    roles: dict[str, str] = field(default_factory=dict)

    @property
    def gap(self) -> float:
        """How far above the lower bound the plan is, as a fraction (0.02 means 2% slower than the bound)."""
        if self.lower_bound_seconds <= 0:
            return 0.0
        return self.predicted_seconds / self.lower_bound_seconds - 1.0
