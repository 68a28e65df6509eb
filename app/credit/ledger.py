"""Credit: samples that entered the collaboration's optimizer steps, per peer key and epoch, counted once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from dedloc_common.contract import MetricsRecord, UtcDateTime
from pydantic import BaseModel, ConfigDict
from sqlalchemy import Select, case, func, select
from sqlalchemy.orm import Session

from app.core.clock import as_utc
from app.identity.models import User
from app.models import Contribution, IssuedPeerToken, Run


@dataclass(frozen=True)
class SignedMetrics:
    """A metrics record and the peer key of the worker that signed it."""

    peer_key: str
    record: MetricsRecord


def users_of_peer_ids(session: Session, run: Run, peer_ids: Iterable[str]) -> dict[str, str]:
    """PeerID -> username from the issued-token table (the first user a key was issued to)."""
    found: dict[str, str] = {}
    query = select(IssuedPeerToken.peer_id, IssuedPeerToken.username).where(
        IssuedPeerToken.run_id == run.id, IssuedPeerToken.peer_id.in_(list(set(peer_ids)))
    ).order_by(IssuedPeerToken.issued_at)
    for peer_id, username in session.execute(query):
        found.setdefault(peer_id, username)
    return found


def samples_total(session: Session, run: Run) -> int:
    """Credited samples of the run (held samples are not counted until released)."""
    credited = func.coalesce(func.sum(Contribution.credited), 0)
    return session.execute(select(credited).where(Contribution.run_id == run.id)).scalar_one()


class LeaderboardEntry(BaseModel):
    """A user on a board: ``samples`` credited, ``held_samples`` held back for review, ``runtime_seconds`` their
    peers spent in credited epochs, ``team`` they represent (or null), ``last_seen`` when an epoch was recorded."""

    model_config = ConfigDict(frozen=True)

    username: str
    samples: int
    runtime_seconds: float
    peers: int
    held_samples: int = 0
    team: Optional[str] = None
    last_seen: Optional[UtcDateTime] = None


def only_public(query: Select, run: Optional[Run] = None) -> Select:
    """``query`` over contributions, joined to their users and leaving hidden users out (a username with no
    user row is public, with no team); limited to ``run`` when one is given."""
    query = query.outerjoin(User, User.username == Contribution.username).where(User.hidden.is_not(True))
    return query if run is None else query.where(Contribution.run_id == run.id)


def credited_runtime():
    """Seconds a contribution adds to its user's runtime: none unless something of it is credited, and at most the
    epoch's length as the coordinator saw it (a claim's own seconds are its word only)."""
    seconds = case((Contribution.observed_seconds < Contribution.seconds, Contribution.observed_seconds),
                   else_=Contribution.seconds)
    return case((Contribution.credited > 0, seconds), else_=0.0)


def credit_columns() -> tuple:
    """The aggregates every board shows: credited, held, runtime (seconds, credited epochs only), peers, last
    recorded epoch."""
    return (
        func.coalesce(func.sum(Contribution.credited), 0).label("samples"),
        func.coalesce(func.sum(Contribution.held), 0).label("held"),
        func.coalesce(func.sum(credited_runtime()), 0.0).label("runtime"),
        func.count(func.distinct(Contribution.peer_key)).label("peers"),
        func.max(Contribution.recorded_at).label("last_seen"),
    )


def leaderboard(session: Session, run: Optional[Run] = None, limit: Optional[int] = 100) -> list[LeaderboardEntry]:
    """Public users by credited samples, most first, in ``run`` or across all runs (``run=None``); the API
    returns these as they are."""
    query = only_public(
        select(Contribution.username, User.team, *credit_columns()).select_from(Contribution), run
    ).group_by(Contribution.username, User.team).order_by(func.sum(Contribution.credited).desc(), Contribution.username)
    return [
        LeaderboardEntry(username=r.username, samples=int(r.samples), runtime_seconds=round(float(r.runtime), 3),
                         peers=int(r.peers), held_samples=int(r.held), team=r.team,
                         last_seen=as_utc(r.last_seen) if r.last_seen else None)
        for r in session.execute(query.limit(limit))
    ]


def credit_by_run(session: Session) -> dict[int, tuple[int, int]]:
    """(credited, held) samples of every run with contributions, by run id, hidden users included."""
    query = select(Contribution.run_id, func.sum(Contribution.credited), func.sum(Contribution.held)).group_by(
        Contribution.run_id)
    return {run_id: (int(credited or 0), int(held or 0)) for run_id, credited, held in session.execute(query)}
