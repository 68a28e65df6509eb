"""Credit: samples that entered the collaboration's optimizer steps, per peer key and epoch, counted once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from dedloc_worker.contract import MetricsRecord
from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from .models import Contribution, Run


@dataclass(frozen=True)
class SignedMetrics:
    """A metrics record and the fingerprint of the key that signed it."""

    peer_key: str
    record: MetricsRecord


def credit_contributions(session: Session, run: Run, seen: Iterable[SignedMetrics]) -> int:
    """Insert a row per (peer key, epoch) not yet credited; returns how many were new.

    Idempotent by the table's unique constraint, so repeated polls, restarts and several coordinators on one
    database never count an epoch twice.
    """
    rows = {
        (item.peer_key, c.epoch): dict(
            run_id=run.id,
            peer_key=item.peer_key,
            epoch=c.epoch,
            username=item.record.username,
            samples=c.samples,
            loss_sum=c.loss_sum,
            mini_steps=c.mini_steps,
            seconds=c.seconds,
            credited=c.samples,
            held=0,
        )
        for item in seen
        for c in item.record.recent
    }
    if not rows:
        return 0
    dialect = postgresql if session.bind.dialect.name == "postgresql" else sqlite
    statement = (
        dialect.insert(Contribution)
        .values(list(rows.values()))
        .on_conflict_do_nothing(index_elements=["run_id", "peer_key", "epoch"])
        .returning(Contribution.id)
    )
    inserted = len(session.execute(statement).all())
    session.commit()
    return inserted


def samples_total(session: Session, run: Run) -> int:
    return session.scalar(select(func.coalesce(func.sum(Contribution.samples), 0)).where(Contribution.run_id == run.id))


@dataclass(frozen=True)
class LeaderboardRow:
    username: str
    samples: int
    runtime_seconds: float
    peers: int


def leaderboard(session: Session, run: Run, limit: int = 100) -> list[LeaderboardRow]:
    """Users by credited samples, most first; runtime is the time their peers spent in credited epochs."""
    query = (
        select(
            Contribution.username,
            func.sum(Contribution.samples).label("samples"),
            func.sum(Contribution.seconds).label("runtime"),
            func.count(func.distinct(Contribution.peer_key)).label("peers"),
        )
        .where(Contribution.run_id == run.id)
        .group_by(Contribution.username)
        .order_by(func.sum(Contribution.samples).desc(), Contribution.username)
        .limit(limit)
    )
    return [LeaderboardRow(r.username, int(r.samples), round(float(r.runtime), 3), int(r.peers)) for r in session.execute(query)]
