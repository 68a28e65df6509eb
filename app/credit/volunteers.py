"""A volunteer's own history, for their "My contribution" page: their peers, their credit per epoch, every epoch
held back and why, and their public settings (hide from boards, represent a team)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Optional

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from app.core.clock import as_utc
from app.core.errors import Invalid
from app.identity.models import User
from app.models import Contribution, Peer, Run
from app.runs.fingerprints import fingerprint

# The page lists this many of the newest (peer, epoch) rows; totals and held epochs cover all of them.
EPOCHS_SHOWN = 500


@dataclass(frozen=True)
class OwnPeer:
    run: str
    fingerprint: str
    hardware: str
    first_seen: datetime
    last_seen: datetime
    reachability: str = ""  # contract.REACHABILITY, as the peer reported it


def own_peers(session: Session, username: str) -> list[OwnPeer]:
    """The user's peer keys in every run, most recently seen first."""
    query = (select(Peer, Run.slug).join(Run, Run.id == Peer.run_id).where(Peer.username == username)
             .order_by(Peer.last_seen.desc(), Peer.id.desc()))
    return [OwnPeer(slug, fingerprint(peer.peer_key), peer.hardware, as_utc(peer.first_seen), as_utc(peer.last_seen),
                    peer.reachability) for peer, slug in session.execute(query)]


@dataclass(frozen=True)
class OwnEpoch:
    """One peer's epoch: samples claimed, credited and held back, why, and who released held credit."""

    run: str
    epoch: int
    fingerprint: str
    claimed: int
    credited: int
    held: int
    seconds: float
    reason: Optional[str]
    released_by: Optional[str]


def _epochs(session: Session, username: str, *conditions, limit: Optional[int] = None) -> list[OwnEpoch]:
    query = (select(Contribution, Run.slug).join(Run, Run.id == Contribution.run_id)
             .where(Contribution.username == username, *conditions)
             .order_by(Contribution.recorded_at.desc(), Contribution.epoch.desc(), Contribution.id.desc()).limit(limit))
    return [OwnEpoch(slug, c.epoch, fingerprint(c.peer_key), c.samples, c.credited, c.held, c.seconds, c.reason,
                     c.released_by) for c, slug in session.execute(query)]


def own_epochs(session: Session, username: str, limit: int = EPOCHS_SHOWN) -> list[OwnEpoch]:
    """The user's newest ``limit`` (peer, epoch) rows, newest first."""
    return _epochs(session, username, limit=limit)


def held_epochs(session: Session, username: str) -> list[OwnEpoch]:
    """Every epoch of the user with samples held back, or not counted for a reason, and not released."""
    return _epochs(session, username, Contribution.released_by.is_(None),
                   or_(Contribution.held > 0, Contribution.reason.is_not(None)))


def change_settings(session: Session, user: User, *, hidden: bool, team: Optional[str]) -> None:
    """Hide ``user`` from (or show them on) public boards and dumps, and set the team they represent: one of
    the organizations their identity provider reported, or none. ``Invalid`` for any other team."""
    team = (team or "").strip() or None
    if team is not None and team not in (user.organizations or []):
        yours = ", ".join(user.organizations or []) or "your sign-in provider reported none"
        raise Invalid(f"you can represent only an organization you belong to ({yours}); "
                      f"sign in again if you joined {team} lately")
    user.hidden, user.team = hidden, team
    session.commit()
