"""Averaging plans as the public sees them: who aggregates which share of the gradient vector, at what bandwidth.

The coordinator writes ``AveragingPlan`` rows; this module only reads them. The public view carries no full
PeerID, key or address (a short fingerprint stands for each peer), and users hidden from public boards read as
``HIDDEN_VOLUNTEER``. ``PublicPlan`` is also the API's response model, so the page and the JSON share one shape.
"""

from __future__ import annotations

from typing import Any, Optional

from dedloc_common.contract import UtcDateTime
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.clock import as_utc
from app.core.errors import NotFound
from app.identity.models import User
from app.models import AveragingPlan, Run
from app.runs.fingerprints import fingerprint

HIDDEN_VOLUNTEER = "hidden volunteer"
NO_PLAN = "no averaging plan was published for this run yet: the coordinator plans once peers report their links"
# Plans stored before entries carried "peer_key" label a peer by its PeerID's last characters instead.
PEER_ID_CHARS = 6


class PlanPeer(BaseModel):
    """A peer of the averaging plan: ``fingerprint`` the first characters of its peer key, the label its owner's
    page shows too (never the whole key; "…" and the PeerID's last characters in plans stored before plans named
    peer keys),
    ``username`` its owner ("hidden volunteer" for users hidden from public boards), ``role`` "aggregator",
    "client" (accepts no connections, aggregates nothing) or "aux" (aggregates, trains nothing), ``share`` of the
    gradient vector it aggregates (a fraction, 0 to 1), its measured bandwidth in Mbit/s, ``device`` where it
    trains ("cuda" or "cpu"; "" in plans stored before plans said), and ``reachability`` how its mode was decided
    (``contract.REACHABILITY``: "reachable", "unreachable" for a peer the portal could not dial back, which went
    client by itself, "client" for one told --client; "" when it did not say, or in older plans)."""

    model_config = ConfigDict(frozen=True)

    fingerprint: str
    username: str
    role: str
    share: float
    upload_mbps: float
    download_mbps: float
    device: str = ""
    reachability: str = ""


class PublicPlan(BaseModel):
    """The run's current averaging plan, largest share first. Times are seconds of one all-reduce round:
    ``predicted_seconds`` by the planner when it made the plan, ``fitted_seconds`` by the round model fitted since
    from ``fitted_rounds`` measured rounds (``latency_seconds`` a round, ``part_seconds`` a part of the vector
    beyond link time; all four null until a round was measured), ``lower_bound_seconds`` no plan can beat (by
    bandwidth alone), ``measured_seconds`` the median of the rounds the peers reported under it (null until one
    did); ``vector_bytes`` the size of the averaged vector."""

    model_config = ConfigDict(frozen=True)

    peers: list[PlanPeer]
    vector_bytes: int
    predicted_seconds: float
    lower_bound_seconds: float
    measured_seconds: Optional[float]
    fitted_seconds: Optional[float] = None
    latency_seconds: Optional[float] = None
    part_seconds: Optional[float] = None
    fitted_rounds: Optional[int] = None
    reason: str
    created_at: UtcDateTime


def current_plan(session: Session, run: Run) -> Optional[AveragingPlan]:
    """The newest plan of ``run``, or None before the coordinator published one."""
    query = (select(AveragingPlan).where(AveragingPlan.run_id == run.id)
             .order_by(AveragingPlan.created_at.desc(), AveragingPlan.id.desc()).limit(1))
    return session.scalar(query)


def public_plan(session: Session, run: Run) -> Optional[PublicPlan]:
    """The public view of the current plan of ``run``, or None when there is none."""
    row = current_plan(session, run)
    return None if row is None else public_view(session, row)


def published_plan(session: Session, run: Run) -> PublicPlan:
    """Like ``public_plan``, but ``NotFound`` when no plan was published yet."""
    plan = public_plan(session, run)
    if plan is None:
        raise NotFound(NO_PLAN)
    return plan


def public_view(session: Session, row: AveragingPlan) -> PublicPlan:
    hidden = hidden_usernames(session, {str(peer.get("username") or "") for peer in row.peers})
    peers = sorted((plan_peer(peer, hidden) for peer in row.peers), key=lambda p: (-p.share, p.role, p.fingerprint))
    return PublicPlan(peers=peers, vector_bytes=row.vector_bytes, predicted_seconds=row.predicted_seconds,
                      lower_bound_seconds=row.lower_bound_seconds, measured_seconds=row.measured_seconds,
                      fitted_seconds=row.fitted_seconds, latency_seconds=row.latency_seconds,
                      part_seconds=row.part_seconds, fitted_rounds=row.fitted_rounds, reason=row.reason,
                      created_at=as_utc(row.created_at))


def plan_peer(peer: dict[str, Any], hidden: set[str]) -> PlanPeer:
    # .get with defaults: rows outlive coordinator versions, and an odd entry must not take the dashboard down.
    username = str(peer.get("username") or "")
    return PlanPeer(
        fingerprint=plan_fingerprint(peer),
        username=HIDDEN_VOLUNTEER if username in hidden else username,
        role=str(peer.get("role") or "client"),
        share=float(peer.get("share") or 0.0),
        upload_mbps=to_mbps(peer.get("upload_bps")),
        download_mbps=to_mbps(peer.get("download_bps")),
        device=str(peer.get("device") or ""),
        reachability=str(peer.get("reachability") or ""),
    )


def plan_fingerprint(peer: dict[str, Any]) -> str:
    """The peer key's fingerprint; for an entry written before entries carried the key, its PeerID's tail."""
    if peer.get("peer_key"):
        return fingerprint(str(peer["peer_key"]))
    return "…" + str(peer.get("peer_id") or "")[-PEER_ID_CHARS:]


def to_mbps(bytes_per_second: Any) -> float:
    """Bytes per second as megabits per second (10^6 bits), the unit links are sold in."""
    return round(float(bytes_per_second or 0.0) * 8 / 1e6, 3)


def hidden_usernames(session: Session, usernames: set[str]) -> set[str]:
    """Those of ``usernames`` whose users hid themselves; a name with no user row is public, as on the boards."""
    if not usernames:
        return set()
    query = select(User.username).where(User.username.in_(usernames), User.hidden.is_(True))
    return set(session.scalars(query))
