"""Crediting: from peers' signed claims and receipts to credited and held samples, once per (peer key, epoch).

A claim is what a peer's metrics record says it put into an epoch's step. A receipt is what another peer, which
aggregated part of that step, says it saw: the sender's weight in the all-reduce, which hivemind sets to the
samples the sender accumulated. A claim is credited up to what another peer's receipt confirms and up to the
run's plausible samples per second; the rest is held with the reason in words.

Claims and receipts meet on the all-reduce round (hivemind's group id), not on epoch numbers: peers one epoch
apart can share a round. Every decision is a pure function of the claim and the receipts of its round, so
repeated polls, late
receipts, a restarted coordinator or two coordinators on one database all end in the same totals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.credit.ledger import SignedMetrics
from app.core.clock import utcnow
from app.models import Contribution, IssuedPeerToken, Peer, Receipt, Run

NO_TOKEN = "no peer token was issued for this key: the swarm cannot tell whose it is"
ALONE = "alone in its averaging group: no other peer confirmed these samples"


@dataclass(frozen=True)
class Decision:
    credited: int
    held: int
    reason: Optional[str]


def decide(claimed: int, seconds: float, confirmations: Sequence[float], ceiling: float) -> Decision:
    """Credit ``claimed`` samples up to the smallest weight other peers saw and up to ``ceiling`` samples/s."""
    confirmed = int(min(confirmations)) if confirmations else 0
    plausible = int(ceiling * seconds)
    credited = max(min(claimed, confirmed, plausible), 0)
    reasons = []
    if not confirmations and claimed:
        reasons.append(ALONE)
    elif confirmed < claimed:
        reasons.append(f"claimed {claimed:,} samples, the peers that averaged with it saw {confirmed:,}")
    # an implausible rate is named even where receipts already hold the claim back: it tells the organizer why
    if plausible < (min(claimed, confirmed) if confirmations else claimed):
        rate = claimed / seconds if seconds > 0 else float("inf")
        reasons.append(f"claimed {rate:,.0f} samples/s, ceiling is {ceiling:,.0f}")
    return Decision(credited, claimed - credited, "; ".join(reasons) or None)


def _insert_ignore(session: Session, model, rows: list[dict], keys: list[str]) -> int:
    if not rows:
        return 0
    dialect = postgresql if session.bind.dialect.name == "postgresql" else sqlite
    statement = dialect.insert(model).on_conflict_do_nothing(index_elements=keys).returning(model.id)
    # executemany: SQLAlchemy batches the rows ("insertmanyvalues") within the drivers' parameter limits
    return len(session.execute(statement, rows).all())


def owners(session: Session, run: Run, peer_keys: Iterable[str]) -> dict[str, tuple[str, str]]:
    """peer key -> (username, PeerID) from the issued-token table."""
    found: dict[str, tuple[str, str]] = {}
    query = select(IssuedPeerToken.peer_key, IssuedPeerToken.username, IssuedPeerToken.peer_id).where(
        IssuedPeerToken.run_id == run.id, IssuedPeerToken.peer_key.in_(list(set(peer_keys)))
    ).order_by(IssuedPeerToken.issued_at)
    for peer_key, username, peer_id in session.execute(query):
        found.setdefault(peer_key, (username, peer_id))  # a key stays with the user it was first issued to
    return found


def credit_epochs(session: Session, run: Run, seen: Sequence[SignedMetrics]) -> int:
    """Record new claims and receipts, then settle every claim of the epochs they touch; returns new claims."""
    known = owners(session, run, (item.peer_key for item in seen))
    claims = {
        (item.peer_key, c.epoch): dict(
            run_id=run.id, peer_key=item.peer_key, epoch=c.epoch,
            username=known.get(item.peer_key, (item.record.username,))[0],
            samples=c.samples, loss_sum=c.loss_sum, mini_steps=c.mini_steps, seconds=c.seconds,
            credited=0, held=c.samples, reason=ALONE, group_id=c.group,
        )
        for item in seen for c in item.record.recent
    }
    receipts = {
        (item.peer_key, group, sender): dict(run_id=run.id, aggregator_key=item.peer_key, group_id=group,
                                             epoch=c.epoch, sender_peer_id=sender, weight=float(weight))
        for item in seen for c in item.record.recent
        for group, senders in c.aggregated.items() for sender, weight in senders.items()
    }
    record_peers(session, run, seen, known)
    new = _insert_ignore(session, Contribution, list(claims.values()), ["run_id", "peer_key", "epoch"])
    _insert_ignore(session, Receipt, list(receipts.values()), ["run_id", "aggregator_key", "group_id", "sender_peer_id"])
    settle(session, run, {row["group_id"] for row in claims.values()} | {group for _, group, _ in receipts})
    session.commit()
    return new


def settle(session: Session, run: Run, groups: set[str]) -> None:
    """Re-decide every claim in the rounds ``groups`` that no organizer released, from all receipts known now."""
    if not groups:
        return
    groups = list(groups)
    rows = session.execute(select(
        Contribution.id, Contribution.peer_key, Contribution.group_id, Contribution.samples, Contribution.seconds,
        Contribution.credited, Contribution.held, Contribution.reason,
    ).where(Contribution.run_id == run.id, Contribution.group_id.in_(groups), Contribution.released_by.is_(None))).all()
    seen_by: dict[tuple[str, str], list[tuple[str, float]]] = {}
    receipts = select(Receipt.group_id, Receipt.sender_peer_id, Receipt.aggregator_key, Receipt.weight).where(
        Receipt.run_id == run.id, Receipt.group_id.in_(groups))
    for group, sender, aggregator, weight in session.execute(receipts):
        seen_by.setdefault((group, sender), []).append((aggregator, weight))
    known = owners(session, run, (row.peer_key for row in rows))
    changes = []
    for row in rows:
        if row.peer_key not in known:
            decision = Decision(0, row.samples, NO_TOKEN)
        else:
            confirmations = [weight for aggregator, weight in seen_by.get((row.group_id, known[row.peer_key][1]), [])
                             if aggregator != row.peer_key and row.group_id]
            decision = decide(row.samples, row.seconds, confirmations, run.samples_per_second_ceiling)
        if (decision.credited, decision.held, decision.reason) != (row.credited, row.held, row.reason):
            changes.append(dict(id=row.id, credited=decision.credited, held=decision.held, reason=decision.reason))
    if changes:
        session.execute(update(Contribution), changes)


def record_peers(session: Session, run: Run, seen: Sequence[SignedMetrics], known: dict) -> None:
    """First and last time each peer key was seen, whose it is, and the hardware it reported."""
    now = utcnow()
    rows = {row.peer_key: row for row in session.scalars(select(Peer).where(
        Peer.run_id == run.id, Peer.peer_key.in_([item.peer_key for item in seen])))}
    for item in seen:
        row = rows.get(item.peer_key)
        if row is None:
            row = rows[item.peer_key] = Peer(run_id=run.id, peer_key=item.peer_key, first_seen=now)
            session.add(row)
        row.username = known.get(item.peer_key, (item.record.username,))[0]
        row.hardware, row.last_seen = item.record.hardware[:200], now
