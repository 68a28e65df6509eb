"""Public standings beyond the per-user board: teams, and one user's totals per run and overall.

Every query here leaves hidden users out (``accounting.only_public``), except where a caller asks for a user's
own totals.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Optional

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.credit.ledger import credit_columns, only_public
from app.identity.models import User
from app.core.errors import NotFound
from app.core.clock import as_utc
from app.models import Contribution, Run

# Same words for hidden and unknown users: a 404 must not tell that a hidden user exists.
NO_PUBLIC_USER = "no public contributor by that name: unknown, or hidden from public boards"


@dataclass(frozen=True)
class Totals:
    """Credited and held samples, runtime (seconds), distinct peer keys, and when an epoch was last recorded."""

    samples: int = 0
    held_samples: int = 0
    runtime_seconds: float = 0.0
    peers: int = 0
    last_seen: Optional[datetime] = None


def totals_of(row) -> Totals:
    return Totals(int(row.samples), int(row.held), round(float(row.runtime), 3), int(row.peers),
                  as_utc(row.last_seen) if row.last_seen else None)


@dataclass(frozen=True)
class TeamRow:
    """A team's standing: the sums of its public members' credit; ``members`` counts those credited or held."""

    team: str
    members: int
    totals: Totals


def team_leaderboard(session: Session, run: Optional[Run] = None, limit: Optional[int] = 100) -> list[TeamRow]:
    """Teams by credited samples, most first, in ``run`` or across runs; users without a team count for none."""
    query = only_public(
        select(User.team, func.count(func.distinct(Contribution.username)).label("members"), *credit_columns())
        .select_from(Contribution), run,
    ).where(User.team.is_not(None)).group_by(User.team).order_by(func.sum(Contribution.credited).desc(), User.team)
    return [TeamRow(r.team, int(r.members), totals_of(r)) for r in session.execute(query.limit(limit))]


@dataclass(frozen=True)
class UserTotals:
    """A user's totals across runs, and per run (slug, totals) in the order the runs were created."""

    username: str
    team: Optional[str]
    totals: Totals
    runs: list[tuple[str, Totals]]


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
    return UserTotals(username, user.team if user else None, totals_of(overall),
                      [(row.slug, totals_of(row)) for row in per_run])
