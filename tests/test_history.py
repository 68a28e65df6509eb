"""The swarm's history thinned as it ages (``app/runs/snapshots.py``): what is kept, on both databases, and the
history API's ``step``."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from app.models import Snapshot
from app.runs import registry, snapshots
from app.runs.snapshots import TIERS, compact_history, thinned

NOW = datetime(2026, 12, 1, 12, 0, 3, tzinfo=timezone.utc)
DAY = 86400

ages = st.lists(st.integers(min_value=0, max_value=90 * DAY), min_size=1, max_size=300)


def tier_bucket(taken_at: datetime):
    """Which interval of which tier a point falls in; None when it is kept at full resolution."""
    widths = [width for older_than, width in TIERS if NOW - taken_at > older_than]
    return (len(widths), int(taken_at.timestamp()) // widths[-1]) if widths else None


@settings(max_examples=200, deadline=None)
@given(ages)
def test_thinning_keeps_the_newest_point_of_every_interval_and_every_recent_point(seconds_ago):
    points = [(i, NOW - timedelta(seconds=age)) for i, age in enumerate(seconds_ago)]
    dropped = thinned(points, NOW)
    kept = [(i, t) for i, t in points if i not in dropped]
    assert dropped <= {i for i, _ in points}

    # The series keeps its shape: every interval that had a point keeps exactly one, its newest (ties: highest id).
    by_bucket: dict = {}
    for i, t in points:
        by_bucket.setdefault(tier_bucket(t), []).append((t, i))
    for bucket, members in by_bucket.items():
        survivors = [i for t, i in members if i not in dropped]
        if bucket is None:
            assert len(survivors) == len(members)  # the last day: every point
        else:
            assert survivors == [max(members)[1]]
    assert max(points, key=lambda p: (p[1], p[0]))[0] not in dropped  # the newest point of all

    # The count is bounded by the recent points plus one per interval, and thinning again changes nothing.
    recent = sum(1 for _, t in points if tier_bucket(t) is None)
    assert len(kept) <= recent + len(by_bucket) - (1 if recent else 0)
    assert thinned(kept, NOW) == set()


def test_ninety_days_of_polls_thin_to_the_documented_bound():
    """A run polled every 20 s for 90 days: the last day whole, then one a minute to 30 days, one an hour after."""
    step = 20
    points = [(i, NOW - timedelta(seconds=i * step)) for i in range(90 * DAY // step)]
    kept = len(points) - len(thinned(points, NOW))
    day, minutes, hours = DAY // step, 29 * 24 * 60, 60 * 24
    assert day + minutes + hours <= kept <= day + minutes + hours + 3  # interval edges may add one each


def test_compaction_and_the_history_step_on_the_database(sessions):
    with sessions() as session:
        run = registry.create_run(session, slug="long", title="A long run")
        # Two hours of polls every 20 s two days ago, and the last ten minutes every 2 s.
        old = [NOW - timedelta(days=2, seconds=s) for s in range(0, 7200, 20)]
        recent = [NOW - timedelta(seconds=s) for s in range(0, 600, 2)]
        for epoch, taken_at in enumerate(sorted(old + recent)):
            session.add(Snapshot(run_id=run.id, taken_at=taken_at, peers_online=2, samples_per_second=100.0,
                                 epoch=epoch, loss=1.0, samples_total=epoch * 100))
        session.commit()

        deleted = compact_history(session, run, NOW)
        session.commit()
        count = session.scalar(select(func.count(Snapshot.id)).where(Snapshot.run_id == run.id))
        minutes = len({int(t.timestamp()) // 60 for t in old})  # 120, or 121 where the hours straddle a minute
        assert minutes in (120, 121)
        assert deleted == len(old) - minutes and count == minutes + len(recent)  # one a minute
        assert compact_history(session, run, NOW) == 0

        hourly = snapshots.history(session, run, limit=1000, step=3600)
        old_hours = [s.taken_at.replace(tzinfo=timezone.utc) for s in hourly if s.epoch < len(old)]
        newest_of_each_hour = {int(t.timestamp()) // 3600: t for t in sorted(old)}
        assert old_hours == sorted(newest_of_each_hour.values())  # 10:00:03 to 12:00:03: hours 10, 11 and 12
        assert hourly[-1].epoch == len(old) + len(recent) - 1  # the newest snapshot leads its hour
        assert len(snapshots.history(session, run, limit=1000)) == count


def test_the_history_api_thins_by_step(start_portal):
    portal = start_portal()
    with portal.db() as session:
        run = registry.create_run(session, slug="steps", title="Steps")
        start = datetime.now(timezone.utc) - timedelta(minutes=10)
        for i in range(300):  # ten minutes, a snapshot every 2 s
            session.add(Snapshot(run_id=run.id, taken_at=start + timedelta(seconds=2 * i), peers_online=1,
                                 samples_per_second=float(i), epoch=i, loss=None, samples_total=i))
        session.commit()
    every = httpx.get(f"{portal.url}/api/v1/runs/steps/history", params={"limit": 1000}).json()
    per_minute = httpx.get(f"{portal.url}/api/v1/runs/steps/history", params={"limit": 1000, "step": 60}).json()
    assert len(every) == 300 and 10 <= len(per_minute) <= 11
    assert per_minute[-1] == every[-1]  # the newest point is always there
    times = [datetime.fromisoformat(p["updated_at"]) for p in per_minute]
    assert times == sorted(times) and all(b - a <= timedelta(seconds=62) for a, b in zip(times, times[1:]))
    refused = httpx.get(f"{portal.url}/api/v1/runs/steps/history", params={"step": -1})
    assert refused.status_code == 422 and "step" in refused.json()["detail"]
