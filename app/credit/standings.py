"""Public standings beyond the per-user board: teams, and one user's totals per run and overall.

Every query here leaves hidden users out (``ledger.only_public``), except where a caller asks for a user's
own totals.
"""

from __future__ import annotations

from typing import Optional

from dedloc_common.contract import UtcDateTime
from pydantic import BaseModel, ConfigDict
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.clock import as_utc
from app.core.errors import NotFound
from app.credit.ledger import credit_columns, only_public
from app.identity.models import User
from app.models import Contribution, Run

# Same words for hidden and unknown users: a 404 must not tell that a hidden user exists.
NO_PUBLIC_USER = "no public contributor by that name: unknown, or hidden from public boards"


class Totals(BaseModel):
    """Credited and held samples, runtime (seconds), distinct peer keys, and when an epoch was last recorded."""

    model_config = ConfigDict(frozen=True)

    samples: int
    held_samples: int
    runtime_seconds: float
    peers: int
    last_seen: Optional[UtcDateTime]


def totals_of(row) -> dict:
    """The ``Totals`` fields of a row of ``ledger.credit_columns``."""
    return dict(samples=int(row.samples), held_samples=int(row.held), runtime_seconds=round(float(row.runtime), 3),
                peers=int(row.peers), last_seen=as_utc(row.last_seen) if row.last_seen else None)


class TeamEntry(Totals):
    """A team on a board: the sums of its public members (``members`` of them credited or held)."""

    team: str
    members: int


def team_leaderboard(session: Session, run: Optional[Run] = None, limit: Optional[int] = 100) -> list[TeamEntry]:
    """Teams by credited samples, most first, in ``run`` or across runs; users without a team count for none."""
    query = only_public(
        select(User.team, func.count(func.distinct(Contribution.username)).label("members"), *credit_columns())
        .select_from(Contribution), run,
    ).where(User.team.is_not(None)).group_by(User.team).order_by(func.sum(Contribution.credited).desc(), User.team)
    return [TeamEntry(team=r.team, members=int(r.members), **totals_of(r)) for r in session.execute(query.limit(limit))]


class RunTotals(Totals):
    """A user's totals in one run."""

    run: str


class UserTotals(Totals):
    """A user's totals across runs, and per run (oldest run first)."""

    username: str
    team: Optional[str]
    runs: list[RunTotals]


def user_totals(session: Session, username: str, public: bool = True) -> UserTotals:
    """``username``'s credit; ``NotFound`` for a name with neither a user row nor a contribution, and, when
    ``public``, for a hidden user. The user's own page asks with ``public=False``."""
    user = session.scalar(select(User).where(User.username == username))
    if public and user is not None and user.hidden:
        raise NotFound(NO_PUBLIC_USER)
    per_run = session.execute(
        select(Run.slug, *credit_columns()).select_from(Contribution).join(Run, Run.id == Contribution.run_id)
        .where(Contribution.username == username).group_by(Run.id, Run.slug).order_by(Run.created_at, Run.id)
    ).all()
    if user is None and not per_run:
        raise NotFound(NO_PUBLIC_USER)
    overall = session.execute(select(*credit_columns()).where(Contribution.username == username)).one()
    return UserTotals(username=username, team=user.team if user else None, **totals_of(overall),
                      runs=[RunTotals(run=row.slug, **totals_of(row)) for row in per_run])
