"""The swarm over time: one row per coordinator poll."""

from __future__ import annotations

from datetime import datetime
from typing import Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import Run, Snapshot


def record_snapshot(session: Session, run: Run, **fields) -> Snapshot:
    snapshot = Snapshot(run_id=run.id, **fields)
    session.add(snapshot)
    session.commit()
    return snapshot


def latest_snapshot(session: Session, run: Run) -> Optional[Snapshot]:
    query = select(Snapshot).where(Snapshot.run_id == run.id).order_by(Snapshot.taken_at.desc(), Snapshot.id.desc())
    return session.scalars(query.limit(1)).first()


def history(session: Session, run: Run, limit: int, since: Optional[datetime] = None) -> list[Snapshot]:
    """The newest ``limit`` snapshots (after ``since`` if given), oldest first."""
    query = select(Snapshot).where(Snapshot.run_id == run.id)
    if since is not None:
        query = query.where(Snapshot.taken_at > since)
    newest = session.scalars(query.order_by(Snapshot.taken_at.desc(), Snapshot.id.desc()).limit(limit))
    return list(reversed(list(newest)))
