"""The samples-per-second ceiling in force for a run: the organizer's where one was set, else derived from the rates
the swarm's confirmed claims show (docs/averaging.md#ceiling).

Derived: each peer key's rate is its confirmed samples among the run's last ``WINDOW_EPOCHS`` epochs over the time
the coordinator's snapshots show those epochs took (the union of their windows: consecutive epochs' windows overlap,
so a rate over many epochs is not inflated by snapshot spacing as one epoch's is), once it has ``MIN_CONFIRMED``
confirmed claims there. An account counts with its fastest key, and the ceiling is ``MULTIPLE`` times the
**second**-fastest account's rate, at most ``DEFAULT_CEILING``: no single account sets it, so a liar whose claims sit
at the ceiling (confirmed: aggregators saw that weight, within the cap) cannot raise it. A claim counts as confirmed
when it was credited in full: other users' peers in its round agreed with it and it was within the ceiling then in
force. Until two accounts have that many, the ceiling is ``DEFAULT_CEILING``. Both the credit decision
(``app.credit.settlement``) and the aggregators' weight cap (carried by the signed averaging plan,
``contract.PlanRecord.ceiling``) use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Optional

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.credit.windows import epoch_windows, observed_span, union_seconds
from app.models import Contribution, Run

DEFAULT_CEILING = 5000.0
"""Samples per second per peer before the swarm has measured rates, and the most a derived ceiling may be: a pair of
colluding accounts that confirm each other's claims can raise the derived ceiling up to it, no further."""
MULTIPLE = 4.0
"""The derived ceiling over the second-fastest account's measured rate: room for an epoch that went faster than a
peer's average, and for a peer up to 4x faster than that account (a GPU joining CPU peers needs an organizer's)."""
WINDOW_EPOCHS = 50
MIN_CONFIRMED = 3  # confirmed claims a peer key needs in the window before its rate counts


@dataclass(frozen=True)
class Ceiling:
    """:param samples_per_second: plausible samples per second per peer
    :param source: "organizer" (set explicitly), "measured" (derived from confirmed rates) or "default"
    """

    samples_per_second: float
    source: str


def derive(rates: Mapping[str, float]) -> Optional[float]:
    """``MULTIPLE`` times the second-fastest of ``rates`` (account -> its measured samples/s), at most
    ``DEFAULT_CEILING``; None where fewer than two accounts have a rate."""
    ranked = sorted((rate for rate in rates.values() if rate > 0), reverse=True)
    return min(MULTIPLE * ranked[1], DEFAULT_CEILING) if len(ranked) >= 2 else None


def measured_rates(session: Session, run: Run) -> dict[str, float]:
    """account -> the rate (samples/s) of its fastest peer key over its claims credited in full among the run's last
    ``WINDOW_EPOCHS`` epochs, for keys with ``MIN_CONFIRMED`` such claims or more."""
    newest = session.scalar(select(func.max(Contribution.epoch)).where(Contribution.run_id == run.id))
    if newest is None:
        return {}
    query = select(Contribution.username, Contribution.peer_key, Contribution.epoch, Contribution.credited,
                   Contribution.recorded_at).where(
        Contribution.run_id == run.id, Contribution.epoch > newest - WINDOW_EPOCHS, Contribution.credited > 0,
        Contribution.held == 0, Contribution.released_by.is_(None), Contribution.observed_seconds > 0)
    claims: dict[tuple[str, str], list[tuple[int, int, datetime]]] = {}
    for username, peer_key, epoch, credited, recorded_at in session.execute(query):
        claims.setdefault((username, peer_key), []).append((epoch, credited, recorded_at))
    claims = {key: found for key, found in claims.items() if len(found) >= MIN_CONFIRMED}
    windows = epoch_windows(session, run, {epoch for found in claims.values() for epoch, _, _ in found})
    rates: dict[str, float] = {}
    for (username, _), found in claims.items():
        seconds = union_seconds(observed_span(windows[epoch], recorded_at) for epoch, _, recorded_at in found)
        if seconds > 0:
            rates[username] = max(rates.get(username, 0.0), sum(credited for _, credited, _ in found) / seconds)
    return rates


def in_force(session: Session, run: Run) -> Ceiling:
    """The organizer's ceiling where one was set (``Run.ceiling_from_organizer``), else the derived one, else
    ``DEFAULT_CEILING``."""
    if run.ceiling_from_organizer:
        return Ceiling(float(run.samples_per_second_ceiling), "organizer")
    derived = derive(measured_rates(session, run))
    return Ceiling(DEFAULT_CEILING, "default") if derived is None else Ceiling(derived, "measured")
