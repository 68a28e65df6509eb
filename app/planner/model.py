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
      of one averaging round does not depend on it: it is carried for the coordinator's step-time estimate.
    :param upload_bps: upload bandwidth, bytes per second
    :param download_bps: download bandwidth, bytes per second
    :param client_mode: the peer cannot accept incoming connections (behind NAT): it sends and receives, but
      never aggregates, so its share is always zero
    :param aux: auxiliary peer: contributes no vector of its own, but may aggregate (a CPU server)
    :param reduce_bps: bytes per second of incoming parts the peer can aggregate (its CPU's rate, serialization
      included); ``math.inf`` where aggregating is never what limits it
    :param reduce_costs_training: aggregating runs on the cores the peer trains on (a CPU peer), so each second it
      spends aggregating during the next accumulation (delayed parameter updates) is a second of training lost
    """

    peer: str
    samples_per_second: float
    upload_bps: float
    download_bps: float
    client_mode: bool = False
    aux: bool = False
    reduce_bps: float = math.inf
    reduce_costs_training: bool = False

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

    @property
    def sends(self) -> bool:
        """Whether the peer contributes a vector to the average (every peer but an auxiliary one)."""
        return not self.aux

    @property
    def can_aggregate(self) -> bool:
        """Whether the peer may be given a non-zero share (it must accept incoming connections)."""
        return not self.client_mode


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
