"""When an epoch ran, by the coordinator's clock: the window between its snapshots around the epoch.

A claim is credited up to the ceiling times its epoch's window (``app.credit.settlement``), and a peer's measured rate
is its confirmed samples over the union of its epochs' windows (``app.credit.ceiling``). Snapshots where no peer was
online say nothing.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from datetime import datetime
from typing import Optional

from sqlalchemy import func, select, tuple_
from sqlalchemy.orm import Session

from app.core.clock import as_utc
from app.models import Contribution, Run, Snapshot

Window = tuple[datetime, Optional[datetime]]


def epoch_window(session: Session, run: Run, epoch: int) -> Window:
    """When ``epoch`` began at the earliest and ended at the latest, by the coordinator's clock: its last snapshot
    before the swarm reached the epoch (else the run's creation), and its first snapshot past the epoch (None while
    there is none)."""
    seen = (Snapshot.run_id == run.id, Snapshot.peers_online > 0)
    began = session.scalar(select(func.min(Snapshot.taken_at)).where(*seen, Snapshot.epoch >= epoch))
    ended = session.scalar(select(func.min(Snapshot.taken_at)).where(*seen, Snapshot.epoch > epoch))
    before = select(func.max(Snapshot.taken_at)).where(*seen, Snapshot.epoch < epoch)
    start = session.scalar(before.where(Snapshot.taken_at < began) if began is not None else before)
    return as_utc(start if start is not None else run.created_at), as_utc(ended) if ended is not None else None


def epoch_windows(session: Session, run: Run, epochs: Iterable[int]) -> dict[int, Window]:
    """``epoch_window`` of each of ``epochs``, from one read of the snapshots since the earliest one's start (no
    snapshot before it can be another of these epochs' start or end)."""
    epochs = sorted(set(epochs))
    if not epochs:
        return {}
    first = epoch_window(session, run, epochs[0])
    snapshots = [(as_utc(taken_at), epoch) for taken_at, epoch in session.execute(
        select(Snapshot.taken_at, Snapshot.epoch).where(Snapshot.run_id == run.id, Snapshot.peers_online > 0,
                                                        Snapshot.taken_at >= first[0]))]
    snapshots.sort(key=lambda snapshot: snapshot[1])  # by epoch
    by_epoch = [epoch for _, epoch in snapshots]
    earliest_from = list(itertools.accumulate(reversed([t for t, _ in snapshots]), min))[::-1]  # min time, suffix
    earlier: list[datetime] = []  # times of the snapshots of epochs before the current one, sorted
    windows, taken = {epochs[0]: first}, 0
    for epoch in epochs[1:]:
        while taken < len(snapshots) and by_epoch[taken] < epoch:
            bisect.insort(earlier, snapshots[taken][0])
            taken += 1
        at, past = bisect.bisect_left(by_epoch, epoch), bisect.bisect_right(by_epoch, epoch)
        began = earliest_from[at] if at < len(snapshots) else None
        ended = earliest_from[past] if past < len(snapshots) else None
        before = bisect.bisect_left(earlier, began) if began is not None else len(earlier)
        windows[epoch] = (earlier[before - 1] if before else first[0], ended)
    return windows


def claim_windows(session: Session, run: Run, claims: Iterable[tuple[str, int]]) -> dict[tuple[str, int], Window]:
    """The window each claim, (peer key, epoch), may cover: its epoch's, from the start of the epoch before where its
    key claimed an earlier epoch but not that one. A peer that fell an epoch behind the swarm trains through both
    before its step and names its claim by the later (``dedloc_worker.training.optimizer``): held to one epoch's
    window, such a claim read as twice its peer's rate, and the ceiling cut honest samples. A key's claims still
    cover each window once, so the ceiling bounds its credit by the time the coordinator saw; a key's first claim
    covers its own epoch only."""
    claims = set(claims)
    if not claims:
        return {}
    keys = {key for key, _ in claims}
    first = dict(session.execute(select(Contribution.peer_key, func.min(Contribution.epoch)).where(
        Contribution.run_id == run.id, Contribution.peer_key.in_(list(keys))).group_by(Contribution.peer_key)).all())
    wanted = [(key, epoch - 1) for key, epoch in claims if first.get(key, epoch) < epoch - 1]
    claimed: set[tuple[str, int]] = set()
    pairs = select(Contribution.peer_key, Contribution.epoch).where(Contribution.run_id == run.id)
    for start in range(0, len(wanted), 500):
        chunk = tuple_(Contribution.peer_key, Contribution.epoch).in_(wanted[start:start + 500])
        claimed.update((key, epoch) for key, epoch in session.execute(pairs.where(chunk)))
    spanning = {(key, epoch + 1) for key, epoch in wanted if (key, epoch) not in claimed}
    windows = epoch_windows(session, run, {epoch for _, epoch in claims} | {epoch - 1 for _, epoch in spanning})
    return {(key, epoch): (windows[epoch - 1][0], windows[epoch][1]) if (key, epoch) in spanning
            else windows[epoch] for key, epoch in claims}


def observed_seconds(window: Window, recorded_at: datetime) -> float:
    """The epoch's length at most: from ``window``'s start to its end, or to when the claim was recorded if that
    came first (the epoch was over by then)."""
    start, end = observed_span(window, recorded_at)
    return max((end - start).total_seconds(), 0.0)


def observed_span(window: Window, recorded_at: datetime) -> tuple[datetime, datetime]:
    """(start, end) of ``observed_seconds``."""
    start, ended = window
    return start, as_utc(recorded_at) if ended is None else min(ended, as_utc(recorded_at))


def union_seconds(spans: Iterable[tuple[datetime, datetime]]) -> float:
    """Seconds covered by at least one of ``spans``: consecutive epochs' windows overlap by a snapshot's spacing."""
    total, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total += (end - start).total_seconds()
            reach = end
        elif end > reach:
            total += (end - reach).total_seconds()
            reach = end
    return max(total, 0.0)
