"""Attestations: what aggregators say they cut from senders' gradient parts, or did not receive.

Each aggregator lists, in its signed metrics record, per round and sender whose receipt is less than its weight
(or that it cut at all), the parts it expected and received, those that were not finite (dropped under robust
aggregation) or all zeros, the parts CenteredClip clipped (and the least fraction of an offset it kept), and the
weight it capped at the run's ceiling (``contract.Attestation``; worker side: ``dedloc_worker.averaging.robust``). The
receipt itself is the weight the sender's parts carried in, so credit follows it; the attestation says why it is less
(``shortfall``). Attestations are stored on that aggregator's receipt for the sender, and shown on the run's dashboard
(recent rounds) and to the sender on /me. They are the aggregator's word, not a verdict: honest senders are clipped when
gradients differ a lot, and lose parts when a link fails or they leave a round early.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.credit.ledger import SignedMetrics, users_of_peer_ids
from app.identity.models import User
from app.models import IssuedPeerToken, Peer, Receipt, Run

SHOWN = 20  # rows on the dashboard
NOT_RECEIVED = "lost in transit or the peer left the round early; this is not an accusation"


@dataclass
class Cut:
    """One aggregator's attestation about one sender in one round, for a page.

    :param sender, aggregator: usernames; None where unknown or hidden from public boards (dashboard only)
    :param weight: samples the sender sent; ``used``: after the cap
    :param expected: parts the sender was to send (0: not said, an older worker); ``nonfinite``: parts not finite,
      dropped or not; ``zeros``: finite parts that were all zeros; ``left_out``: why the aggregator left the sender
      out of the round (its announced share was not its plan's), "" where it did not
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
    expected: int = 0
    nonfinite: int = 0
    zeros: int = 0
    left_out: str = ""

    @property
    def capped(self) -> bool:
        return self.used < self.weight

    @property
    def words(self) -> str:
        """What was cut, in words."""
        said = [f"left out of the round: {self.left_out}"] if self.left_out else []
        if self.expected > self.parts:
            said.append(f"{self.expected - self.parts} of {self.expected} parts not received ({NOT_RECEIVED})")
        if self.dropped:
            said.append(f"{self.dropped} of {self.parts} parts dropped (not finite)")
        elif self.nonfinite:
            said.append(f"{self.nonfinite} of {self.parts} parts not finite (averaged in: the run uses the plain "
                        "mean)")
        if all_zeros(vars(self)):
            said.append(f"all {self.parts - max(self.nonfinite, self.dropped)} finite parts were zeros: they carry "
                        "no credit")
        if self.clipped:
            said.append(f"{self.clipped} of {self.parts} parts clipped (at least {100 * self.kept:.1f}% of the "
                        "offset from the centre kept)")
        if self.capped:
            said.append(f"weight capped from {self.weight:,.0f} to {self.used:,.0f} samples by the run's ceiling")
        return "; ".join(said) or "nothing cut"


def missing(note: Mapping) -> int:
    """Parts the sender was to send and the aggregator did not receive (0 where an older worker did not say)."""
    return max(int(note.get("expected", 0)) - int(note.get("parts", 0)), 0)


def nonfinite(note: Mapping) -> int:
    """Parts that were not finite (older workers said so as ``dropped`` only)."""
    return max(int(note.get("nonfinite", 0)), int(note.get("dropped", 0)))


def all_zeros(note: Mapping) -> bool:
    """Whether every finite part the aggregator received was all zeros (a sender of zeros contributed nothing)."""
    finite = int(note.get("parts", 0)) - nonfinite(note)
    return finite > 0 and int(note.get("zeros", 0)) >= finite


def applied(note: Mapping) -> float:
    """The weight (samples) the sender's parts carried in, as the worker computes it for its receipts
    (``dedloc_worker.averaging.robust.Attestation.applied``): the used weight times the share of the expected parts that
    came
    and were finite, 0 when those were all zeros. A receipt counts no more than its own aggregator's note says."""
    parts = int(note.get("parts", 0))
    finite = parts - nonfinite(note)
    if finite <= 0 or all_zeros(note):
        return 0.0
    return max(float(note.get("used", 0.0)), 0.0) * finite / max(int(note.get("expected", 0)), parts)


def lost_in_transit(note: Optional[Mapping]) -> bool:
    """Whether a receipt is short only because parts did not arrive (nothing not finite, zeros or capped)."""
    return (note is not None and missing(note) > 0 and not nonfinite(note) and not all_zeros(note)
            and float(note.get("used", 0.0)) >= float(note.get("weight", 0.0)))


def shortfall(notes: Sequence[Mapping]) -> str:
    """Why the receipts of one sender (one aggregator's note each) are less than its weight, in words, summed over
    the aggregators; "" when the notes say nothing. Lost parts are told apart from parts not finite or zeros."""
    said = []
    lost = [note for note in notes if missing(note)]
    if lost:
        said.append(f"{sum(map(missing, lost)):,} of {sum(int(n['expected']) for n in lost):,} parts did not reach "
                    f"{_aggregators(len(lost))} ({NOT_RECEIVED})")
    bad = [note for note in notes if nonfinite(note)]
    if bad:
        said.append(f"{sum(map(nonfinite, bad)):,} of {sum(int(n.get('parts', 0)) for n in bad):,} parts it sent "
                    f"{_aggregators(len(bad))} were not finite (NaN or infinity) and carry no credit")
    zeros = [note for note in notes if all_zeros(note)]
    if zeros:
        said.append(f"every part it sent {_aggregators(len(zeros))} was zeros, which adds nothing to a step")
    capped = [note for note in notes if float(note.get("used", 0.0)) < float(note.get("weight", 0.0))]
    if capped:
        said.append(f"{_aggregators(len(capped))} capped its weight at the run's ceiling")
    return "aggregators report: " + "; ".join(said) if said else ""


def _aggregators(count: int) -> str:
    return "an aggregator" if count == 1 else f"{count} aggregators"


def record(session: Session, run: Run, seen: Sequence[SignedMetrics]) -> set[str]:
    """Store the attestations in ``seen`` on their receipts (inserting a receipt the record did not carry yet: an
    attestation can close a later epoch than the receipt of the same round). Call before the caller commits.
    Returns the rounds whose attestations changed: their claims are decided again."""
    changed = set()
    for item in seen:
        for contribution in item.record.recent:
            for group, senders in contribution.attested.items():
                for sender, note in senders.items():
                    if _attest(session, run, item.peer_key, group, contribution.epoch, sender, note.dict()):
                        changed.add(group)
    return changed


def _attest(session: Session, run: Run, aggregator_key: str, group: str, epoch: int, sender: str,
            note: dict) -> bool:
    where = (Receipt.run_id == run.id, Receipt.aggregator_key == aggregator_key, Receipt.group_id == group,
             Receipt.sender_peer_id == sender)
    found = session.execute(select(Receipt.id, Receipt.attestation).where(*where)).first()
    if found is None:
        session.add(Receipt(run_id=run.id, aggregator_key=aggregator_key, group_id=group, epoch=epoch,
                            sender_peer_id=sender, weight=applied(note)))
        session.flush()
    elif found.attestation == note:
        return False  # republished with the claim it rides in: nothing new
    session.execute(update(Receipt).where(*where).values(attestation=note))
    return True


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
        run = session.get_one(Run, run_id)
        cuts += _cuts(session, run, [row for row in rows if row.run_id == run_id], public=False)
    return sorted(cuts, key=lambda cut: (cut.run, -cut.epoch))


def _cuts(session: Session, run: Run, rows: Sequence[Receipt], public: bool) -> list[Cut]:
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
                kept=float(row.attestation.get("kept", 1.0)), expected=int(row.attestation.get("expected", 0)),
                nonfinite=int(row.attestation.get("nonfinite", 0)), zeros=int(row.attestation.get("zeros", 0)),
                left_out=str(row.attestation.get("left_out") or ""))
            for row in rows if row.attestation is not None]  # the callers select only receipts with one
