"""Attestations: what aggregators say they cut from senders' gradient parts under robust aggregation.

Each aggregator lists, in its signed metrics record, per round and sender, the parts it dropped as not finite,
the parts CenteredClip clipped (and the least fraction of an offset it kept), and the weight it capped at the
run's ceiling (``contract.Attestation``; worker side: ``dedloc_worker.robust``). They are stored on that
aggregator's receipt for the sender, and shown on the run's dashboard (recent rounds) and to the sender on /me.
An attestation is the aggregator's word, not a verdict: honest senders are clipped too when gradients differ a lot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.credit.ledger import SignedMetrics
from app.identity.models import User
from app.models import IssuedPeerToken, Peer, Receipt, Run

SHOWN = 20  # rows on the dashboard


@dataclass
class Cut:
    """One aggregator's attestation about one sender in one round, for a page.

    :param sender, aggregator: usernames; None where unknown or hidden from public boards (dashboard only)
    :param weight: samples the sender sent; ``used``: after the cap
    """

    run: str
    group: str
    epoch: int
    sender: Optional[str]
    aggregator: Optional[str]
    parts: int
    weight: float
    used: float
    dropped: int
    clipped: int
    kept: float

    @property
    def capped(self) -> bool:
        return self.used < self.weight

    @property
    def words(self) -> str:
        """What was cut, in words."""
        said = []
        if self.dropped:
            said.append(f"{self.dropped} of {self.parts} parts dropped (not finite)")
        if self.clipped:
            said.append(f"{self.clipped} of {self.parts} parts clipped (at least {100 * self.kept:.1f}% of the "
                        "offset from the centre kept)")
        if self.capped:
            said.append(f"weight capped from {self.weight:,.0f} to {self.used:,.0f} samples by the run's ceiling")
        return "; ".join(said) or "nothing cut"


def record(session: Session, run: Run, seen: Sequence[SignedMetrics]) -> None:
    """Store the attestations in ``seen`` on their receipts (inserting a receipt the record did not carry yet: an
    attestation can close a later epoch than the receipt of the same round). Call before the caller commits."""
    for item in seen:
        for contribution in item.record.recent:
            for group, senders in contribution.attested.items():
                for sender, note in senders.items():
                    _attest(session, run, item.peer_key, group, contribution.epoch, sender, note.dict())


def _attest(session: Session, run: Run, aggregator_key: str, group: str, epoch: int, sender: str, note: dict):
    where = (Receipt.run_id == run.id, Receipt.aggregator_key == aggregator_key, Receipt.group_id == group,
             Receipt.sender_peer_id == sender)
    if session.scalar(select(Receipt.id).where(*where)) is None:
        session.add(Receipt(run_id=run.id, aggregator_key=aggregator_key, group_id=group, epoch=epoch,
                            sender_peer_id=sender, weight=float(note["weight"])))
        session.flush()
    session.execute(update(Receipt).where(*where).values(attestation=note))


def recent_cuts(session: Session, run: Run, limit: int = SHOWN) -> list[Cut]:
    """The newest attestations of ``run``, with public usernames only."""
    rows = session.scalars(select(Receipt).where(Receipt.run_id == run.id, Receipt.attestation.is_not(None))
                           .order_by(Receipt.id.desc()).limit(limit)).all()
    return _cuts(session, run, rows, public=True)


def own_cuts(session: Session, username: str, limit: int = 50) -> list[Cut]:
    """The newest attestations about the senders (PeerIDs) issued to ``username``, in any run."""
    peer_ids = select(IssuedPeerToken.peer_id).where(IssuedPeerToken.username == username)
    rows = session.scalars(select(Receipt).where(Receipt.attestation.is_not(None),
                                                 Receipt.sender_peer_id.in_(peer_ids))
                           .order_by(Receipt.id.desc()).limit(limit)).all()
    cuts = []
    for run_id in sorted({row.run_id for row in rows}):
        run = session.get(Run, run_id)
        cuts += _cuts(session, run, [row for row in rows if row.run_id == run_id], public=False)
    return sorted(cuts, key=lambda cut: (cut.run, -cut.epoch))


def _cuts(session: Session, run: Run, rows: Sequence[Receipt], public: bool) -> list[Cut]:
    from app.credit.settlement import users_of_peer_ids  # settlement records attestations: imported late

    senders = users_of_peer_ids(session, run, {row.sender_peer_id for row in rows})
    aggregators = dict(session.execute(select(Peer.peer_key, Peer.username).where(
        Peer.run_id == run.id, Peer.peer_key.in_({row.aggregator_key for row in rows}))).all())
    hidden = set(session.scalars(select(User.username).where(User.hidden.is_(True)))) if public else set()

    def shown(username: Optional[str]) -> Optional[str]:
        return None if username is None or username in hidden else username

    return [Cut(run=run.slug, group=row.group_id[:8], epoch=row.epoch, sender=shown(senders.get(row.sender_peer_id)),
                aggregator=shown(aggregators.get(row.aggregator_key)), parts=int(row.attestation.get("parts", 0)),
                weight=float(row.attestation.get("weight", row.weight)), used=float(row.attestation.get("used", 0.0)),
                dropped=int(row.attestation.get("dropped", 0)), clipped=int(row.attestation.get("clipped", 0)),
                kept=float(row.attestation.get("kept", 1.0)))
            for row in rows]
