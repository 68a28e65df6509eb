"""The swarm over time: one row per coordinator poll, thinned as it ages.

A poll every 2 s is 43,200 rows a day. ``compact_history`` keeps every snapshot of the last day, then the last one
of each minute up to 30 days, then the last one of each hour (``TIERS``): a run holds at most about 85,000 rows
in its first month and 8,760 more a year after that (docs/architecture.md, "History").
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Iterable, Optional, Sequence

from sqlalchemy import Integer, cast, delete, extract, func, select
from sqlalchemy.orm import Session

from app.core.clock import as_utc, utcnow
from app.models import Run, Snapshot

# (older than, keep one snapshot per this many seconds): the first tier's age is where thinning starts.
TIERS: tuple[tuple[timedelta, int], ...] = ((timedelta(days=1), 60), (timedelta(days=30), 3600))
DELETE_CHUNK = 500  # ids per DELETE: SQLite allows 32,766 parameters, PostgreSQL far more; small keeps locks short
COMPACT_EVERY = timedelta(minutes=10)
# When this process last thinned each run's history: only the run's one coordinator writes its snapshots.
_compacted_at: dict[int, datetime] = {}


def record_snapshot(session: Session, run: Run, **fields) -> Snapshot:
    """Add one snapshot, and thin the run's older history every ``COMPACT_EVERY``; committed."""
    snapshot = Snapshot(run_id=run.id, **fields)
    session.add(snapshot)
    now = utcnow()
    if now - _compacted_at.get(run.id, datetime.min.replace(tzinfo=now.tzinfo)) >= COMPACT_EVERY:
        compact_history(session, run, now)
        _compacted_at[run.id] = now
    session.commit()
    return snapshot


def latest_snapshot(session: Session, run: Run) -> Optional[Snapshot]:
    query = select(Snapshot).where(Snapshot.run_id == run.id).order_by(Snapshot.taken_at.desc(), Snapshot.id.desc())
    return session.scalars(query.limit(1)).first()


def first_taken_at(session: Session, run: Run) -> Optional[datetime]:
    """When the run's oldest kept snapshot was taken (UTC), or None before the first."""
    taken = session.scalar(select(func.min(Snapshot.taken_at)).where(Snapshot.run_id == run.id))
    return None if taken is None else as_utc(taken)


def history(session: Session, run: Run, limit: int, since: Optional[datetime] = None, step: int = 0
            ) -> list[Snapshot]:
    """The newest ``limit`` snapshots (after ``since`` if given), oldest first; with ``step`` (seconds), only the
    newest snapshot of each ``step``-long interval, so that a chart of weeks needs a few hundred points."""
    query = select(Snapshot).where(Snapshot.run_id == run.id)
    if since is not None:
        query = query.where(Snapshot.taken_at > since)
    if step > 1:
        # Whole seconds since 1970 on both SQLite and PostgreSQL; integer division buckets them alike on both.
        bucket = cast(extract("epoch", Snapshot.taken_at), Integer) // step
        newest_of_each = query.with_only_columns(func.max(Snapshot.id)).group_by(bucket)
        query = select(Snapshot).where(Snapshot.id.in_(newest_of_each))
    newest = session.scalars(query.order_by(Snapshot.taken_at.desc(), Snapshot.id.desc()).limit(limit))
    return list(reversed(list(newest)))


def thinned(points: Iterable[tuple[int, datetime]], now: datetime,
            tiers: Sequence[tuple[timedelta, int]] = TIERS) -> set[int]:
    """The ids of ``points`` (id, taken_at) that thinning drops: in each tier, all but the newest point of each
    interval of the tier's width. Points younger than the first tier's age are never dropped."""
    newest: dict[tuple[int, int], tuple[datetime, int]] = {}
    dropped: set[int] = set()
    for point_id, taken_at in points:
        age = now - as_utc(taken_at)
        widths = [width for older_than, width in tiers if age > older_than]
        if not widths:
            continue
        key = (len(widths), int(as_utc(taken_at).timestamp()) // widths[-1])
        candidate = (as_utc(taken_at), point_id)
        kept = newest.get(key)
        if kept is None:
            newest[key] = candidate
        elif candidate > kept:
            newest[key] = candidate
            dropped.add(kept[1])
        else:
            dropped.add(point_id)
    return dropped


def compact_history(session: Session, run: Run, now: datetime) -> int:
    """Thin the run's snapshots older than the first tier (``thinned``); returns how many were deleted.
    Not committed. Reads only (id, taken_at) of the rows concerned: at most the bounded thinned history."""
    cutoff = now - TIERS[0][0]
    rows = session.execute(select(Snapshot.id, Snapshot.taken_at).where(
        Snapshot.run_id == run.id, Snapshot.taken_at < cutoff)).all()
    doomed = sorted(thinned(((row.id, row.taken_at) for row in rows), now))
    for start in range(0, len(doomed), DELETE_CHUNK):
        session.execute(delete(Snapshot).where(Snapshot.id.in_(doomed[start:start + DELETE_CHUNK])))
    return len(doomed)
