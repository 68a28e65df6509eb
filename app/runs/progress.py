"""How far a run is from its end: the target in optimizer steps, and the time left with a range that comes from
how much the swarm's throughput varied lately (its quartiles over the recent snapshots)."""

from __future__ import annotations

import statistics
from typing import Optional

from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from app.models import Run
from app.runs import snapshots

RECENT_SNAPSHOTS = 120  # a few minutes at the coordinator's poll interval


class RunProgress(BaseModel):
    """``GET /api/v1/runs/{slug}/progress``: seconds left to the target as (low, expected, high); None where
    there is no target or no throughput to go by."""

    state: str
    epoch: int
    target_epochs: Optional[int]
    fraction_done: Optional[float] = Field(None, ge=0, le=1)
    eta_seconds: Optional[float] = None
    eta_low_seconds: Optional[float] = None
    eta_high_seconds: Optional[float] = None


def run_progress(session: Session, run: Run) -> RunProgress:
    recent = [s for s in snapshots.history(session, run, RECENT_SNAPSHOTS) if s.samples_per_second > 0]
    latest = snapshots.latest_snapshot(session, run)
    epoch = latest.epoch if latest is not None else 0
    progress = RunProgress(state=run.state or "active", epoch=epoch, target_epochs=run.target_epochs)
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
    remaining = max((run.target_epochs - epoch) * run.target_batch_size - accumulated, 0)
    speeds = sorted(s.samples_per_second for s in recent)
    low, high = (statistics.quantiles(speeds, n=4)[::2] if len(speeds) >= 4 else (speeds[0], speeds[-1]))
    progress.eta_seconds = round(remaining / statistics.median(speeds), 1)
    progress.eta_low_seconds = round(remaining / high, 1)  # faster swarm, sooner end
    progress.eta_high_seconds = round(remaining / low, 1)
    return progress
