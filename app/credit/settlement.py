"""Crediting: from peers' signed claims and receipts to credited and held samples, once per (peer key, epoch).

A claim is what a peer's metrics record says it put into an epoch's step: its samples, the all-reduce round
(hivemind's group id) they went into, and that round's members (PeerIDs) as hivemind formed it. A receipt is what
a peer that aggregated part of that round says it saw: the weight the sender's parts carried into the average
(hivemind sets it to the samples the sender accumulated; the aggregator counts it after the run's cap, for the share
of the parts that arrived finite, and not at all for parts that were all zeros), never more than the aggregator's
own attestation of those parts says (``app.credit.attestations``). Where receipts are short, the reason names why,
telling parts lost on the way (no accusation, and no dispute against the aggregator) from parts not finite or zeros.

Who confirms a claim: only receipts from peers that (a) belong to another user than the claimant, by the
issued-token table (``owners``), and (b) were members of the round as the round's members' own signed records attest
it: the claimant's record lists the aggregator, or the aggregator's own claim for that round lists the claimant
(``listed_by``). A claimant that leaves an honest aggregator out of its list therefore cannot turn that aggregator's
correct receipt into a dispute against it. One user's several peers are one voice (the median of what they saw).
Receipts from the claimant's own account count for nothing, so one user's peers cannot vouch for each other, however
their records list each other (a Sybil pair is one voice). A griefer that lists its victim in its own claim for the
victim's round gains a vote and no more: the victim's claim and every other user's receipt vote against it (it is
outvoted, a dispute against the griefer), and with the griefer the only other user the claim is held as disputed,
both sides shown, as for any word against word.

What is credited: the value a strict majority agrees on among the claimant (its claim) and each other user of the
round (what their peers saw, counted up to the claim). A receipt against that majority is recorded as a dispute
against its author (``Dispute``); it does not cut the claim. Without a majority (one other user who saw less than
was claimed, or a split), the claim is held as disputed: what every side agrees on is credited, the rest waits for
an organizer, who sees both sides (``app.credit.review``). A receipt from a peer that was not in the round counts
for nothing and, where it says less than the claim, is recorded as a dispute against its author too.

Then the ceiling: a claim is credited up to the run's samples-per-second ceiling (the organizer's, else derived from
the swarm's confirmed rates: ``app.credit.ceiling``) times the epoch's length as the
coordinator's clock saw it (``observed_seconds``: from its last snapshot before the epoch began to its first after
the epoch ended; from the epoch before where its key skipped that one, ``windows.claim_windows``), whatever the claim
says its own seconds were. The rest is held, with the reason in words. An account
one of whose peers failed a spot check, or had a drawn claim a check could not judge (``app.credit.spot_checks``),
has every claim held, of any of its peer keys, with the check's evidence, until an organizer lifts the hold.

Claims and receipts meet on the round, not on epoch numbers: peers one epoch apart can share a round. Every
decision is a function of what the database holds (claims, receipts, snapshots), so repeated polls, late receipts,
a restarted coordinator or two coordinators on one database all end in the same totals.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any, Iterable, Optional, Sequence

from dedloc_common.contract import REACHABILITY
from sqlalchemy import delete, func, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.credit import attestations
from app.credit.ceiling import in_force as ceiling_in_force
from app.credit.decision import (  # noqa: F401  (re-exported: the names settlement's callers use)
    ALONE,
    NO_MEMBERS,
    NO_ROUND,
    NO_TOKEN,
    NOT_A_MEMBER,
    NOT_ACCUSED,
    OUTVOTED,
    REASON_LENGTH,
    UNRESOLVED,
    Decision,
    decide,
    same_account,
    unfinished,
    view_of,
)
from app.credit.ledger import SignedMetrics, users_of_peer_ids
from app.credit.spot_checks import account_holds
from app.credit.windows import claim_windows, observed_seconds
from app.models import Contribution, Dispute, IssuedPeerToken, Peer, Receipt, Run


def _insert_new(session: Session, model, rows: dict[tuple, dict], keys: list[str], known: Iterable[tuple]) -> list:
    """Insert the ``rows`` (by their key values, in ``keys`` order) that are not ``known``; returns their keys.
    Workers republish every unacknowledged claim each poll, so most rows of a poll are known."""
    new = [key for key in rows.keys() - set(known)]
    if new:
        dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
        statement = dialect.insert(model).on_conflict_do_nothing(index_elements=keys)  # a concurrent coordinator
        # On the connection, without RETURNING: the driver's own executemany (psycopg pipelines it). The ORM's bulk
        # path and SQLAlchemy's multi-row VALUES cost seconds in Python for a 1,000-peer epoch (16,000 receipts).
        session.connection().execute(statement, [rows[key] for key in new])
    return new


def _chunks(items: list, size: int = 1000):
    for start in range(0, len(items), size):
        yield items[start:start + size]


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
    """Record new claims and receipts, then settle every claim of the rounds they touch; returns new claims."""
    known = owners(session, run, (item.peer_key for item in seen))
    claims: dict[tuple, dict[str, Any]] = {
        (run.id, item.peer_key, c.epoch): dict(
            run_id=run.id, peer_key=item.peer_key, epoch=c.epoch,
            username=known.get(item.peer_key, (item.record.username,))[0],
            samples=c.samples, loss_sum=c.loss_sum, mini_steps=c.mini_steps, seconds=c.seconds,
            credited=0, held=c.samples, reason=None, group_id=c.group, members=list(c.members),
            compute_seconds=c.compute_seconds, sent_bytes=c.sent_bytes,
        )
        for item in seen for c in item.record.recent
    }
    receipts = {
        (run.id, item.peer_key, group, sender): dict(run_id=run.id, aggregator_key=item.peer_key, group_id=group,
                                             epoch=c.epoch, sender_peer_id=sender, weight=float(weight))
        for item in seen for c in item.record.recent
        for group, senders in c.aggregated.items() for sender, weight in senders.items()
    }
    record_peers(session, run, seen, known)
    claimants = sorted({key for _, key, _ in claims})
    known_claims = [row for chunk in _chunks(claimants) for row in session.execute(
        select(Contribution.run_id, Contribution.peer_key, Contribution.epoch).where(
            Contribution.run_id == run.id, Contribution.peer_key.in_(chunk)))]
    rounds = sorted({group for _, _, group, _ in receipts})
    known_receipts = [row for chunk in _chunks(rounds) for row in session.execute(
        select(Receipt.run_id, Receipt.aggregator_key, Receipt.group_id, Receipt.sender_peer_id).where(
            Receipt.run_id == run.id, Receipt.group_id.in_(chunk)))]
    new = _insert_new(session, Contribution, claims, ["run_id", "peer_key", "epoch"], map(tuple, known_claims))
    new_receipts = _insert_new(session, Receipt, receipts, ["run_id", "aggregator_key", "group_id", "sender_peer_id"],
                               map(tuple, known_receipts))
    attested = attestations.record(session, run, seen)
    # Only rounds with something new are decided again: a decision is a function of the claims, receipts and
    # attestations held (organizers' releases, a new ceiling and failed spot checks settle their own claims).
    groups = {claims[key]["group_id"] for key in new} | {group for _, _, group, _ in new_receipts} | attested
    settle(session, run, groups, ungrouped=[key[1:] for key in new if not claims[key]["group_id"]])
    session.commit()
    return len(new)


def acknowledgements(session: Session, run: Run, peer_keys: Iterable[str]) -> dict[str, int]:
    """peer key -> the newest epoch of its claims the database holds: what the coordinator acknowledges. Each
    metrics record carries the oldest claims its worker has not seen acknowledged (all of them, or as many as fit:
    ``dedloc_worker.credit.outbox``), so all claims up to it are here."""
    query = select(Contribution.peer_key, func.max(Contribution.epoch)).where(
        Contribution.run_id == run.id, Contribution.peer_key.in_(list(set(peer_keys)))).group_by(Contribution.peer_key)
    return {peer_key: int(epoch) for peer_key, epoch in session.execute(query)}


def settle(session: Session, run: Run, groups: Iterable[str], ungrouped: Sequence[tuple[str, int]] = ()) -> None:
    """Re-decide every claim in the rounds ``groups`` (and the round-less claims ``ungrouped``, by (peer key,
    epoch)) that no organizer released, from all receipts known now; keep their disputes in step."""
    groups = sorted(group for group in groups if group)
    columns = (Contribution.id, Contribution.peer_key, Contribution.group_id, Contribution.epoch, Contribution.samples,
               Contribution.recorded_at, Contribution.credited, Contribution.held, Contribution.reason,
               Contribution.members, Contribution.observed_seconds)
    mine = (Contribution.run_id == run.id, Contribution.released_by.is_(None))
    rows: list[Any] = []
    listed_by: dict[tuple[str, str], set[str]] = {}  # (round, claim key) -> the members its claim lists
    if groups:  # released claims decide nothing, but their members lists still attest who was in the round
        for row in session.execute(select(*columns, Contribution.released_by).where(
                Contribution.run_id == run.id, Contribution.group_id.in_(groups))):
            listed_by.setdefault((row.group_id, row.peer_key), set()).update(row.members or ())
            if row.released_by is None:
                rows.append(row)
    if ungrouped:
        rows += session.execute(select(*columns).where(
            *mine, Contribution.group_id == "", tuple_(Contribution.peer_key, Contribution.epoch).in_(list(ungrouped))))
    if not rows:
        return
    seen_by: dict[tuple[str, str], list[tuple[str, float, Optional[dict]]]] = {}
    if groups:
        receipts = select(Receipt.group_id, Receipt.sender_peer_id, Receipt.aggregator_key, Receipt.weight,
                          Receipt.attestation).where(Receipt.run_id == run.id, Receipt.group_id.in_(groups))
        for group, sender, aggregator, weight, note in session.execute(receipts):
            # a receipt counts no more than its aggregator's own note says the parts carried in (an older worker's
            # receipt is the weight of the first part, whatever came after it)
            weight = min(weight, attestations.applied(note)) if note else weight
            seen_by.setdefault((group, sender), []).append((aggregator, weight, note))
    known = owners(session, run, {row.peer_key for row in rows} | {
        aggregator for found in seen_by.values() for aggregator, _, _ in found})
    member_users = users_of_peer_ids(session, run, {member for row in rows for member in (row.members or ())})
    windows = claim_windows(session, run, {(row.peer_key, row.epoch) for row in rows})
    ceiling = ceiling_in_force(session, run).samples_per_second  # the organizer's, or derived from confirmed rates
    # an account a spot check holds (failed, or a drawn claim it could not judge) is held, whichever key it uses
    checked = account_holds(session, run, {known[row.peer_key][0] for row in rows if row.peer_key in known})
    changes: list[dict[str, Any]] = []
    disputes: dict[tuple[str, str, str], dict[str, Any]] = {}  # (round, claim key, aggregator key) -> a Dispute
    for row in rows:
        window = observed_seconds(windows[row.peer_key, row.epoch], row.recorded_at)
        if row.peer_key not in known:
            decision = Decision(0, row.samples, NO_TOKEN)
        elif known[row.peer_key][0] in checked:
            decision = Decision(0, row.samples, checked[known[row.peer_key][0]].reason_for(row.peer_key))
        else:
            decision = _decide_row(row, known, member_users, seen_by, listed_by, run, window, disputes, ceiling)
        now = (decision.credited, decision.held, decision.reason, window)
        if now != (row.credited, row.held, row.reason, row.observed_seconds):
            changes.append(dict(id=row.id, credited=decision.credited, held=decision.held, reason=decision.reason,
                                observed_seconds=window))
    if changes:
        session.execute(update(Contribution), changes)
    _keep_disputes(session, run, rows, disputes)


def settle_account(session: Session, run: Run, username: str) -> None:
    """Re-decide every claim of ``username``'s peer keys in ``run`` that no organizer released: after a spot check
    holds the account, or an organizer lifts the hold."""
    rows = session.execute(select(Contribution.group_id, Contribution.peer_key, Contribution.epoch).where(
        Contribution.run_id == run.id, Contribution.username == username)).all()
    settle(session, run, {group for group, _, _ in rows if group},
           ungrouped=[(peer_key, epoch) for group, peer_key, epoch in rows if not group])


def _decide_row(row, known, member_users, seen_by, listed_by, run: Run, window: float, disputes: dict,
                ceiling: float) -> Decision:
    """One claim's decision; the disputes it raises go into ``disputes`` by (round, claim key, aggregator key).

    :param listed_by: (round, peer key) -> the PeerIDs that peer's own claims for that round list as members: an
        aggregator whose claim lists the claimant was in the round by its own signed word, whatever the claimant's
        list says
    """
    username, peer_id = known[row.peer_key]
    members = set(row.members or ())
    counted, outsiders, own, notes = [], [], [], {}
    for aggregator, weight, note in seen_by.get((row.group_id, peer_id), []) if row.group_id else []:
        if aggregator == row.peer_key or aggregator not in known:
            continue
        author, author_peer_id = known[aggregator]
        if author == username:
            own.append(weight)
        elif author_peer_id in members or peer_id in listed_by.get((row.group_id, aggregator), ()):
            counted.append((aggregator, author, weight))
            notes[aggregator] = note
        else:
            outsiders.append((aggregator, author, weight))
    voices: dict[str, list[float]] = {}
    for _, author, weight in counted:
        voices.setdefault(author, []).append(weight)
    others = {member_users[m] for m in members if m in member_users} - {username}
    seen = {author: statistics.median_low(weights) for author, weights in voices.items()}
    # hivemind's own weight 0 (a peer catching up or leaving tags along): no aggregator's note cut it
    weightless = bool(counted) and all(weight == 0 and not notes[aggregator] for aggregator, _, weight in counted)
    # users each of whose receipts below the claim is short only by parts that did not arrive
    short_by = [(author, attestations.lost_in_transit(notes[aggregator])) for aggregator, author, weight in counted
                if view_of(weight, row.samples) < row.samples]
    in_transit = {author for author, _ in short_by} - {author for author, lost in short_by if not lost}
    decision = decide(row.samples, window, seen, ceiling, round_formed=bool(row.group_id), members_listed=bool(members),
                      others_in_round=len(others), own_account=own, username=username, weightless=weightless,
                      in_transit=in_transit)
    decision = _with_shortfall(decision, row.samples, [note for note in notes.values() if note])

    def against(aggregator: str, author: str, weight: float, kind: str) -> None:
        disputes[(row.group_id, row.peer_key, aggregator)] = dict(
            run_id=run.id, group_id=row.group_id, epoch=row.epoch, claim_key=row.peer_key, claimant=username,
            claimed=row.samples, aggregator_key=aggregator, author=author, seen=float(weight), kind=kind)

    for aggregator, author, weight in counted:
        view = view_of(weight, row.samples)
        if decision.agreed is not None and view != decision.agreed:
            if not attestations.lost_in_transit(notes[aggregator]):  # parts that did not arrive are no dispute
                against(aggregator, author, weight, OUTVOTED)
        elif decision.disputed and view < row.samples:
            against(aggregator, author, weight, UNRESOLVED)
    if members:  # a claim from a worker that lists no members cannot tell who was there: nobody is blamed
        for aggregator, author, weight in outsiders:
            if view_of(weight, row.samples) < row.samples:
                against(aggregator, author, weight, NOT_A_MEMBER)
    return decision


def _with_shortfall(decision: Decision, claimed: int, notes: list[dict]) -> Decision:
    """``decision`` with the aggregators' account of why their receipts are short (parts not received, not finite,
    zeros, a capped weight) added to its reason, where it credits less than claimed."""
    words = attestations.shortfall(notes) if decision.credited < claimed else ""
    if not words:
        return decision
    reason = f"{decision.reason}; {words}" if decision.reason else words
    return replace(decision, reason=reason[:REASON_LENGTH])


def _keep_disputes(session: Session, run: Run, rows, wanted: dict) -> None:
    """Make the disputes of the settled claims exactly ``wanted``."""
    claims = list({(row.group_id, row.peer_key) for row in rows})
    existing = {}
    for chunk in range(0, len(claims), 500):
        query = select(Dispute).where(Dispute.run_id == run.id,
                                      tuple_(Dispute.group_id, Dispute.claim_key).in_(claims[chunk:chunk + 500]))
        existing.update({(d.group_id, d.claim_key, d.aggregator_key): d for d in session.scalars(query)})
    gone = [d.id for key, d in existing.items() if key not in wanted]
    if gone:
        session.execute(delete(Dispute).where(Dispute.id.in_(gone)))
    for key, values in wanted.items():
        found = existing.get(key)
        if found is None:
            session.add(Dispute(**values))
        elif (found.kind, found.seen, found.claimed, found.author) != (values["kind"], values["seen"],
                                                                        values["claimed"], values["author"]):
            found.kind, found.seen, found.claimed, found.author = (values["kind"], values["seen"], values["claimed"],
                                                                   values["author"])


def record_peers(session: Session, run: Run, seen: Sequence[SignedMetrics], known: dict) -> None:
    """First and last time each peer key was seen, whose it is, the hardware and reachability it reported."""
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
        if item.record.reachability in REACHABILITY:
            row.reachability = item.record.reachability
        if item.record.memory is not None:
            row.memory = item.record.memory.dict()
