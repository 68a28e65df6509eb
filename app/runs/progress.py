"""How far a run is from its end: the target in optimizer steps, and the time left with a range that comes from
how much the swarm's throughput varied lately (its quartiles over the recent snapshots)."""

from __future__ import annotations

import statistics
from typing import Optional

from dedloc_common.contract import OptimizerOptions, outer_batch_of
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from app.models import Run
from app.runs import snapshots

RECENT_SNAPSHOTS = 120  # a few minutes at the coordinator's poll interval
RECENT_CLAIMS = 500  # the newest (peer, epoch) claims behind the share of rounds that did not form
RECENT_ROUNDS = 5  # outer rounds a local-updates run's progress details


class PeerInRound(BaseModel):
    username: str
    inner_steps: int  # mini-batches, each an inner optimizer step
    samples: int
    seconds: float  # from the peer's previous outer round to the end of this one
    # payload bytes the peer sent in the round per sample it averaged in, and the share of its seconds spent in
    # forward and backward passes; None where its worker did not report them
    bytes_per_sample: Optional[float] = None
    compute_share: Optional[float] = None


class RoundDetail(BaseModel):
    epoch: int
    peers: list[PeerInRound]


class RunProgress(BaseModel):
    """``GET /api/v1/runs/{slug}/progress``: seconds left to the target as (low, expected, high); None where
    there is no target or no throughput to go by."""

    state: str
    # large-batch: an epoch is an optimizer step on the averaged gradient; local-updates: an outer round
    # (docs/training-algorithms.md), of outer_batch_size samples
    algorithm: str = "large-batch"
    outer_batch_size: Optional[int] = None
    epoch: int
    target_epochs: Optional[int]
    fraction_done: Optional[float] = Field(None, ge=0, le=1)
    eta_seconds: Optional[float] = None
    eta_low_seconds: Optional[float] = None
    eta_high_seconds: Optional[float] = None
    # Of the newest claims, how many went into no averaging round (hivemind found no group; the peer stepped alone).
    claims_recent: int = 0
    rounds_not_formed: int = 0
    # local-updates: the newest outer rounds, each peer's inner steps and samples in it, as their claims say
    recent_rounds: list[RoundDetail] = []


def run_progress(session: Session, run: Run) -> RunProgress:
    recent = [s for s in snapshots.history(session, run, RECENT_SNAPSHOTS) if s.samples_per_second > 0]
    latest = snapshots.latest_snapshot(session, run)
    epoch = latest.epoch if latest is not None else 0
    options = OptimizerOptions(**(run.optimizer or {}))
    local = options.algorithm == "local-updates"
    progress = RunProgress(state=run.state or "active", algorithm=options.algorithm,
                           outer_batch_size=outer_batch_of(options, run.target_batch_size) if local else None,
                           epoch=epoch, target_epochs=run.target_epochs, **rounds_not_formed(session, run))
    if local:
        progress.recent_rounds = recent_rounds(session, run)
    if run.target_epochs is None:
        return progress
    progress.fraction_done = min(epoch / run.target_epochs, 1.0)
    if run.state == "finished" or epoch >= run.target_epochs:
        progress.fraction_done, progress.eta_seconds = 1.0, 0.0
        progress.eta_low_seconds = progress.eta_high_seconds = 0.0
        return progress
    if not recent:
        return progress
    accumulated = latest.samples_accumulated if latest is not None else 0
    per_epoch = progress.outer_batch_size or run.target_batch_size  # an outer round's samples, or a step's
    remaining = max((run.target_epochs - epoch) * per_epoch - accumulated, 0)
    speeds = sorted(s.samples_per_second for s in recent)
    low, high = (statistics.quantiles(speeds, n=4)[::2] if len(speeds) >= 4 else (speeds[0], speeds[-1]))
    progress.eta_seconds = round(remaining / statistics.median(speeds), 1)
    progress.eta_low_seconds = round(remaining / high, 1)  # faster swarm, sooner end
    progress.eta_high_seconds = round(remaining / low, 1)
    return progress


def rounds_not_formed(session: Session, run: Run) -> dict:
    """Among the newest claims with samples, those whose peer averaged with nobody (no round id)."""
    from sqlalchemy import select

    from app.models import Contribution

    groups = session.scalars(select(Contribution.group_id).where(Contribution.run_id == run.id,
                                                                 Contribution.samples > 0)
                             .order_by(Contribution.epoch.desc(), Contribution.id.desc()).limit(RECENT_CLAIMS)).all()
    return dict(claims_recent=len(groups), rounds_not_formed=sum(1 for group in groups if not group))


def recent_rounds(session: Session, run: Run, count: int = RECENT_ROUNDS) -> list[RoundDetail]:
    """The newest ``count`` outer rounds anyone claimed samples in, newest first, each peer's claim in it."""
    from sqlalchemy import select

    from app.models import Contribution

    epochs = session.scalars(select(Contribution.epoch).where(Contribution.run_id == run.id, Contribution.samples > 0)
                             .distinct().order_by(Contribution.epoch.desc()).limit(count)).all()
    if not epochs:
        return []
    rows = session.scalars(select(Contribution).where(Contribution.run_id == run.id, Contribution.epoch.in_(epochs),
                                                      Contribution.samples > 0)
                           .order_by(Contribution.epoch.desc(), Contribution.username)).all()
    rounds: dict[int, RoundDetail] = {}
    for row in rows:
        detail = rounds.setdefault(row.epoch, RoundDetail(epoch=row.epoch, peers=[]))
        detail.peers.append(PeerInRound(
            username=row.username, inner_steps=row.mini_steps, samples=row.samples, seconds=round(row.seconds, 1),
            bytes_per_sample=None if row.sent_bytes is None else round(row.sent_bytes / row.samples, 1),
            compute_share=None if row.compute_seconds is None or row.seconds <= 0
            else round(min(row.compute_seconds / row.seconds, 1.0), 3)))
    return list(rounds.values())
