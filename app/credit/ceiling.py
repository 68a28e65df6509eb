"""The samples-per-second ceiling in force for a run: the organizer's where one was set, else derived from the rates
the swarm's confirmed claims show (docs/averaging.md#ceiling).

Derived: for every peer key with at least ``MIN_CONFIRMED`` confirmed claims among the run's last ``WINDOW_EPOCHS``
epochs, the median of their rates (credited samples over the epoch's length as the coordinator saw it, the very
measure a claim is held to); the ceiling is ``MULTIPLE`` times the fastest such median, at most ``DEFAULT_CEILING``.
A claim counts as confirmed when it was credited in full: other users' peers in its round agreed with it and it was
within the ceiling then in force. Until some peer has that many, the ceiling is ``DEFAULT_CEILING``. Both the
credit decision (``app.credit.settlement``) and the aggregators' weight cap (carried by the signed averaging plan,
``contract.PlanRecord.ceiling``) use it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.models import Contribution, Run

DEFAULT_CEILING = 5000.0
"""Samples per second per peer before the swarm has measured rates, and the most a derived ceiling may be: a pair of
colluding accounts that confirm each other's claims can raise the derived ceiling up to it, no further."""
MULTIPLE = 4.0
"""The derived ceiling over the fastest confirmed peer's median rate: room for an epoch that went faster than the
peer's median, and for a peer faster than any confirmed so far (a GPU joining CPU peers needs an organizer's)."""
WINDOW_EPOCHS = 50
MIN_CONFIRMED = 3  # confirmed claims a peer key needs in the window before its median counts


@dataclass(frozen=True)
class Ceiling:
    """:param samples_per_second: plausible samples per second per peer
    :param source: "organizer" (set explicitly), "measured" (derived from confirmed rates) or "default"
    """

    samples_per_second: float
    source: str


def derive(rates: Mapping[str, Iterable[float]]) -> Optional[float]:
    """``MULTIPLE`` times the fastest median among peers with ``MIN_CONFIRMED`` rates or more (samples/s), at most
    ``DEFAULT_CEILING``; None where no peer has that many."""
    medians = [statistics.median(found) for found in map(list, rates.values()) if len(found) >= MIN_CONFIRMED]
    medians = [median for median in medians if median > 0]
    return min(MULTIPLE * max(medians), DEFAULT_CEILING) if medians else None


def confirmed_rates(session: Session, run: Run) -> dict[str, list[float]]:
    """peer key -> the rates (samples/s) of its claims credited in full among the run's last ``WINDOW_EPOCHS``."""
    newest = session.scalar(select(func.max(Contribution.epoch)).where(Contribution.run_id == run.id))
    if newest is None:
        return {}
    query = select(Contribution.peer_key, Contribution.credited, Contribution.observed_seconds).where(
        Contribution.run_id == run.id, Contribution.epoch > newest - WINDOW_EPOCHS, Contribution.credited > 0,
        Contribution.held == 0, Contribution.released_by.is_(None), Contribution.observed_seconds > 0)
    rates: dict[str, list[float]] = {}
    for peer_key, credited, seconds in session.execute(query):
        assert seconds is not None  # the query keeps only observed_seconds > 0
        rates.setdefault(peer_key, []).append(credited / seconds)
    return rates


def in_force(session: Session, run: Run) -> Ceiling:
    """The organizer's ceiling where one was set (``Run.ceiling_from_organizer``), else the derived one, else
    ``DEFAULT_CEILING``."""
    if run.ceiling_from_organizer:
        return Ceiling(float(run.samples_per_second_ceiling), "organizer")
    derived = derive(confirmed_rates(session, run))
    return Ceiling(DEFAULT_CEILING, "default") if derived is None else Ceiling(derived, "measured")
