"""What the averaging planner reads and writes: peer profiles in, a plan out.

Units throughout the planner: bandwidths in bytes per second (not bits), vector sizes in bytes, times in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.core.errors import Invalid


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
    """

    peer: str
    samples_per_second: float
    upload_bps: float
    download_bps: float
    client_mode: bool = False
    aux: bool = False

    def __post_init__(self) -> None:
        if not self.peer:
            raise PlanningError("a peer profile needs a non-empty peer id")
        for name in ("upload_bps", "download_bps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise PlanningError(f"peer {self.peer}: {name} must be a positive number of bytes/s, got {value}")
        if not (math.isfinite(self.samples_per_second) and self.samples_per_second >= 0):
            raise PlanningError(f"peer {self.peer}: samples_per_second must be >= 0, got {self.samples_per_second}")

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
    """

    shares: dict[str, float]
    predicted_seconds: float
    lower_bound_seconds: float

    @property
    def gap(self) -> float:
        """How far above the lower bound the plan is, as a fraction (0.02 means 2% slower than the bound)."""
        if self.lower_bound_seconds <= 0:
            return 0.0
        return self.predicted_seconds / self.lower_bound_seconds - 1.0
