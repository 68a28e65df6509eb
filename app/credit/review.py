"""Organizers' review of held credit: what is held in a run and why, and releasing it.

A release is final: the row is credited in full (``credited = samples``), remembers who released it, and keeps
its reason with "(released by X)" so the volunteer's page still tells the story.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.errors import NotFound
from app.models import Contribution, Run

REASON_LENGTH = Contribution.__table__.c.reason.type.length


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

