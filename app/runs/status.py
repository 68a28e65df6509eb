"""A run's health at a glance: its coordinators up or down with their last heartbeat, its peers by reachability,
and the portal's version (``GET /api/v1/runs/{slug}/status`` and the run page's status section)."""

from __future__ import annotations

from datetime import datetime, timedelta
from importlib.metadata import PackageNotFoundError, version
from typing import List, Optional

from dedloc_common.contract import UtcDateTime
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.models import Coordinator, Run
from app.runs import registry, snapshots


class CoordinatorStatus(BaseModel):
    peer_id: str = Field(description="its libp2p PeerID (public: it is in every bootstrap address)")
    up: bool = Field(description="beat within the portal's coordinator timeout and did not stop since")
    last_heartbeat: Optional[UtcDateTime] = Field(description="its newest heartbeat, None if it never beat")
    started_at: UtcDateTime
    stopped_at: Optional[UtcDateTime] = Field(None, description="when it stopped cleanly, if it did")


class PeerCounts(BaseModel):
    """Peers online at the newest snapshot, by how their mode was decided (they add up to ``online``)."""

    online: int = Field(ge=0)
    reachable: int = Field(ge=0, description="full peers: the dial-back reached them (or they were not tested)")
    unreachable: int = Field(ge=0, description="found unreachable by the dial-back: in client mode by themselves")
    client: int = Field(ge=0, description="in client mode by their own choice (--client)")
    seen_at: Optional[UtcDateTime] = Field(None, description="the snapshot's time; None when there is none")


class RunStatus(BaseModel):
    """``GET /api/v1/runs/{slug}/status``."""

    slug: str
    coordinators_up: int = Field(ge=0)
    coordinators: List[CoordinatorStatus] = Field(description="every coordinator that ever served the run, newest "
                                                  "heartbeat first")
    notice: Optional[str] = Field(None, description="in words, when no coordinator is up; None otherwise")
    peers: PeerCounts
    portal_version: str
    checked_at: UtcDateTime


def portal_version() -> str:
    try:
        return version("dedloc")
    except PackageNotFoundError:  # a checkout run without `pip install -e .`
        return "unknown"


def run_status(session: Session, run: Run, coordinator_timeout: float) -> RunStatus:
    now = utcnow()
    since = now - timedelta(seconds=coordinator_timeout)
    rows = session.scalars(select(Coordinator).where(Coordinator.run_id == run.id))
    coordinators = sorted(
        (CoordinatorStatus(peer_id=row.peer_id, up=registry.is_up(row, since), last_heartbeat=row.heartbeat_at,
                           started_at=row.started_at, stopped_at=row.stopped_at) for row in rows),
        key=lambda c: c.last_heartbeat or datetime.min.replace(tzinfo=now.tzinfo), reverse=True)
    up = sum(c.up for c in coordinators)
    return RunStatus(slug=run.slug, coordinators_up=up, coordinators=coordinators, peers=peer_counts(session, run),
                     notice=None if up else registry.no_coordinator_notice(session, run),
                     portal_version=portal_version(), checked_at=now)


def peer_counts(session: Session, run: Run) -> PeerCounts:
    latest = snapshots.latest_snapshot(session, run)
    if latest is None:
        return PeerCounts(online=0, reachable=0, unreachable=0, client=0)
    client, unreachable = latest.peers_client, latest.peers_unreachable
    return PeerCounts(online=latest.peers_online, reachable=max(latest.peers_online - client - unreachable, 0),
                      unreachable=unreachable, client=client, seen_at=latest.taken_at)
