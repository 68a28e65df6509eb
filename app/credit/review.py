"""Organizers' review of held credit: what is held in a run and why, the disputes behind it, releasing it, lifting
the hold spot checks put on an account, and the run's samples-per-second ceiling.

A release is final: the row is credited in full (``credited = samples``), remembers who released it, and keeps
its reason with "(released by X)" so the volunteer's page still tells the story.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.errors import Invalid, NotFound
from app.credit.settlement import NOT_A_MEMBER, OUTVOTED, UNRESOLVED, settle, settle_account
from app.credit.spot_checks import holds
from app.models import Contribution, Dispute, Run, SpotCheck, max_length

REASON_LENGTH = max_length(Contribution, "reason")


@dataclass(frozen=True)
class HeldCredit:
    """A user's held credit in one run: epochs with something held, samples held, the distinct reasons."""

    username: str
    epochs: list[int]
    held_samples: int
    reasons: list[str]


def held_credit(session: Session, run: Run) -> list[HeldCredit]:
    """Users with held samples in ``run``, most held first."""
    rows = session.execute(
        select(Contribution.username, Contribution.epoch, Contribution.held, Contribution.reason)
        .where(Contribution.run_id == run.id, Contribution.held > 0).order_by(Contribution.epoch)
    ).all()
    by_user: dict[str, list] = {}
    for row in rows:
        by_user.setdefault(row.username, []).append(row)
    found = [HeldCredit(username, sorted({r.epoch for r in held}), sum(r.held for r in held),
                        list(dict.fromkeys(r.reason or "no reason recorded" for r in held)))
             for username, held in by_user.items()]
    return sorted(found, key=lambda item: (-item.held_samples, item.username))


def released_reason(reason: Optional[str], released_by: str) -> str:
    suffix = f" (released by {released_by})"
    return (reason or "held")[: REASON_LENGTH - len(suffix)] + suffix


def release_held(session: Session, *, run: Run, username: str, released_by: str, epoch: Optional[int] = None) -> int:
    """Credit ``username``'s held samples in ``run`` (one ``epoch``, or all) in full; returns the samples released.
    ``NotFound`` when nothing of theirs is held there."""
    query = select(Contribution).where(Contribution.run_id == run.id, Contribution.username == username,
                                       Contribution.held > 0)
    if epoch is not None:
        query = query.where(Contribution.epoch == epoch)
    rows = session.scalars(query.with_for_update()).all()
    if not rows:
        where = f" in epoch {epoch}" if epoch is not None else ""
        raise NotFound(f"{username} has no held credit in run {run.slug!r}{where}")
    released = sum(row.held for row in rows)
    for row in rows:
        row.credited, row.held, row.released_by = row.samples, 0, released_by
        row.reason = released_reason(row.reason, released_by)
    session.commit()
    return released


def lift_holds(session: Session, run: Run, username: str, lifted_by: str) -> int:
    """An organizer ends the hold spot checks put on ``username``'s account: its claims are decided again as any
    other's (receipts, ceiling). Returns the checks lifted; ``NotFound`` when none holds the account."""
    checks = [check for check in session.scalars(select(SpotCheck).where(
        SpotCheck.run_id == run.id, SpotCheck.username == username).with_for_update()) if holds(check)]
    if not checks:
        raise NotFound(f"no spot check holds {username}'s credit in run {run.slug!r}")
    for check in checks:
        check.lifted_by = lifted_by
    session.flush()
    settle_account(session, run, username)
    session.commit()
    return len(checks)


@dataclass(frozen=True)
class DisputedClaim:
    """A claim held as disputed: no majority in its round. Both sides: what the claimant says, what the other
    user's peer saw."""

    claimant: str
    epoch: int
    claimed: int
    author: str
    seen: int


@dataclass(frozen=True)
class Disputer:
    """A user whose receipts disagreed with a round's majority (``outvoted``) or came from outside the round
    (``not_a_member``), and in how many claims."""

    username: str
    outvoted: int
    not_a_member: int


def disputed_claims(session: Session, run: Run, limit: int = 200) -> list[DisputedClaim]:
    """Held claims without a majority in their round, newest epoch first, with the receipts against them."""
    query = (select(Dispute.claimant, Dispute.epoch, Dispute.claimed, Dispute.author, Dispute.seen)
             .join(Contribution, (Contribution.run_id == Dispute.run_id) & (Contribution.peer_key == Dispute.claim_key)
                   & (Contribution.group_id == Dispute.group_id))
             .where(Dispute.run_id == run.id, Dispute.kind == UNRESOLVED, Contribution.held > 0)
             .order_by(Dispute.epoch.desc(), Dispute.claimant, Dispute.author).limit(limit))
    return [DisputedClaim(claimant, epoch, claimed, author, int(round(seen)))
            for claimant, epoch, claimed, author, seen in session.execute(query)]


def disputers(session: Session, run: Run) -> list[Disputer]:
    """Authors of receipts the crediting did not follow, most disputes first."""
    query = (select(Dispute.author, Dispute.kind, func.count()).where(
        Dispute.run_id == run.id, Dispute.kind.in_([OUTVOTED, NOT_A_MEMBER])).group_by(Dispute.author, Dispute.kind))
    counts: dict[str, dict[str, int]] = {}
    for author, kind, count in session.execute(query):
        counts.setdefault(author, {})[kind] = int(count)
    found = [Disputer(author, kinds.get(OUTVOTED, 0), kinds.get(NOT_A_MEMBER, 0)) for author, kinds in counts.items()]
    return sorted(found, key=lambda item: (-(item.outvoted + item.not_a_member), item.username))


def change_ceiling(session: Session, run: Run, samples_per_second: float) -> int:
    """Set the run's plausible samples per second per peer, and re-decide every claim held now (and not released)
    under it; claims settled from now on use it too. Returns the claims re-decided. ``Invalid`` unless positive."""
    if not samples_per_second > 0 or samples_per_second == float("inf"):
        raise Invalid("the samples-per-second ceiling must be a positive number")
    run.samples_per_second_ceiling, run.ceiling_from_organizer = float(samples_per_second), True
    held = session.execute(select(Contribution.group_id, Contribution.peer_key, Contribution.epoch).where(
        Contribution.run_id == run.id, Contribution.held > 0, Contribution.released_by.is_(None))).all()
    settle(session, run, {group for group, _, _ in held if group},
           ungrouped=[(key, epoch) for group, key, epoch in held if not group])
    session.commit()
    return len(held)
