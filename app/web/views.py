"""Shaping database rows into API schemas, shared by the JSON API, the live stream and the pages."""

from __future__ import annotations

from typing import Optional

from sqlalchemy.orm import Session

from app.models import Run, Snapshot
from app.runs.snapshots import latest_snapshot
from app.web.schemas import RunOut, SwarmOut


def run_out(run: Run) -> RunOut:
    return RunOut.model_validate(run, from_attributes=True)


def swarm_out(run: Run, snapshot: Optional[Snapshot]) -> SwarmOut:
    """The swarm as last seen; an idle swarm (no snapshot yet) reads as zeros, not as an error."""
    if snapshot is None:
        return SwarmOut(
            peers_online=0, samples_per_second=0.0, epoch=0, loss=None, samples_total=0, samples_accumulated=0,
            eta_seconds=None, target_batch_size=run.target_batch_size, updated_at=None,
        )
    return SwarmOut(
        peers_online=snapshot.peers_online,
        samples_per_second=snapshot.samples_per_second,
        epoch=snapshot.epoch,
        loss=snapshot.loss,
        samples_total=snapshot.samples_total,
        samples_accumulated=snapshot.samples_accumulated,
        eta_seconds=snapshot.eta_seconds,
        target_batch_size=run.target_batch_size,
        updated_at=snapshot.taken_at,
    )


def current_swarm(session: Session, run: Run) -> SwarmOut:
    return swarm_out(run, latest_snapshot(session, run))

