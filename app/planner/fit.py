"""The round model's costs beyond bandwidth, fitted from the rounds a swarm measured.

Each peer reports its last all-reduce: seconds, payload bytes sent and received. Against the link figures the
planner uses for it, the bandwidth model explains ``max(sent / u, received / d)`` of those seconds; what is left is
fitted as ``latency + part_seconds * parts``, ``parts`` the parts of the binding direction, by non-negative least
squares with a soft L1 loss (``scipy.optimize.least_squares``), so that a straggler's round weighs little. Why these two
terms: docs/averaging.md#fitted-round-model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from scipy import optimize

from app.planner.model import BANDWIDTH_ONLY, PlanningError, RoundCosts

# One measured round already beats bandwidth alone, which is off by two orders of magnitude on a small model; a
# slow swarm may complete only a round or two under a plan (docs/averaging.md#fitted-round-model).
MIN_ROUNDS = 1


@dataclass(frozen=True)
class RoundObservation:
    """One peer's measured round.

    :param seconds: the round's duration as the peer measured it, seconds
    :param sent_bytes: payload bytes the peer sent in it
    :param received_bytes: payload bytes it received
    :param upload_bps: the upload figure the planner uses for the peer, bytes per second
    :param download_bps: its download figure, bytes per second
    """

    seconds: float
    sent_bytes: float
    received_bytes: float
    upload_bps: float
    download_bps: float

    def __post_init__(self) -> None:
        if not (self.seconds > 0 and self.upload_bps > 0 and self.download_bps > 0):
            raise PlanningError("a measured round needs positive seconds and link figures")

    @property
    def link_seconds(self) -> float:
        """What the bandwidth model alone says the peer needed."""
        return max(self.sent_bytes / self.upload_bps, self.received_bytes / self.download_bps)

    @property
    def binding_bytes(self) -> float:
        """Bytes of the direction that bound the peer in the bandwidth model."""
        up, down = self.sent_bytes / self.upload_bps, self.received_bytes / self.download_bps
        return self.sent_bytes if up >= down else self.received_bytes


def fit_round_costs(observations: Iterable[RoundObservation], part_bytes: float) -> RoundCosts:
    """Latency and per-part cost that best explain ``observations`` beyond their link time (least squares, both
    >= 0); bandwidth alone before ``MIN_ROUNDS`` rounds are known."""
    rounds = list(observations)
    if len(rounds) < MIN_ROUNDS:
        return BANDWIDTH_ONLY
    design = np.array([[1.0, r.binding_bytes / part_bytes] for r in rounds])
    left = np.array([max(r.seconds - r.link_seconds, 0.0) for r in rounds])
    # Columns scaled to 1 so that nnls treats a 1-part and a 10,000-part round alike.
    scale = np.maximum(np.abs(design).max(axis=0), 1e-12)
    scaled = design / scale
    start, _ = optimize.nnls(scaled, left)
    # A round that waited on a straggler (several times the others) pulls a least-squares fit towards it; the soft L1
    # loss weighs such a round about as a median would, so the fit predicts the typical round.
    spread = max(float(np.median(left)) / 4, 1e-4)
    latency, per_part = optimize.least_squares(lambda x: scaled @ x - left, start, bounds=(0.0, np.inf),
                                               loss="soft_l1", f_scale=spread).x
    return RoundCosts(latency_seconds=float(latency / scale[0]), part_seconds=float(per_part / scale[1]),
                      part_bytes=float(part_bytes), rounds=len(rounds))
