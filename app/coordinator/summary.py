"""Turning what the DHT holds into one swarm snapshot (pure functions, no hivemind)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from dedloc_common.contract import mean_loss

from app.credit.ledger import SignedMetrics


@dataclass(frozen=True)
class PeerSeen:
    """A fresh progress record: where one peer stands (samples, samples per second)."""

    peer_key: str
    epoch: int
    samples_accumulated: int
    samples_per_second: float
    client_mode: bool = False


def latest_loss(metrics: Sequence[SignedMetrics]) -> Optional[float]:
    """Mean loss over every peer's mini-steps in the newest epoch any peer closed."""
    closed = [c for item in metrics for c in item.record.recent]
    if not closed:
        return None
    newest = max(c.epoch for c in closed)
    return mean_loss([c for c in closed if c.epoch == newest])


def summarize(
    peers: Sequence[PeerSeen], metrics: Sequence[SignedMetrics], target_batch_size: int, samples_total: int
) -> dict:
    """Snapshot fields: peers online (and how many of them are in client mode, by choice or found unreachable),
    throughput (samples/s), epoch, loss, totals and ETA (seconds)."""
    epochs = [p.epoch for p in peers] or [item.record.epoch for item in metrics] or [0]
    epoch = max(epochs)
    speed = sum(p.samples_per_second for p in peers)
    accumulated = sum(p.samples_accumulated for p in peers if p.epoch == epoch)
    eta = max(target_batch_size - accumulated, 0) / speed if speed > 0 else None
    reachability = {item.peer_key: item.record.reachability for item in metrics}
    unreachable = sum(reachability.get(p.peer_key) == "unreachable" for p in peers)
    return dict(
        peers_online=len(peers),
        peers_unreachable=unreachable,
        peers_client=sum(p.client_mode for p in peers) - sum(
            p.client_mode and reachability.get(p.peer_key) == "unreachable" for p in peers),
        samples_per_second=round(speed, 3),
        epoch=epoch,
        loss=latest_loss(metrics),
        samples_total=samples_total,
        samples_accumulated=accumulated,
        eta_seconds=None if eta is None else round(eta, 3),
    )
