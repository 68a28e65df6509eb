"""Progress reports at a bounded rate (dedloc_worker.tracker), read back from a real DHT."""

from __future__ import annotations

import gc
import time

import pytest
from dedloc_worker.swarm import create_dht
from dedloc_worker.tracker import ThrottledProgressTracker

from tests.support.harness import wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
PERIOD = 2.0  # seconds between two reports of one epoch: long enough that a busy machine cannot blur it


@pytest.fixture
def tracker():
    dht = create_dht([], "/ip4/127.0.0.1/tcp/0", client_mode=False)
    tracked = ThrottledProgressTracker(dht, "throttle-test", 10**9, min_refresh_period=PERIOD, start=True)
    try:
        yield tracked
    finally:
        tracked.shutdown()
        dht.shutdown()
        gc.collect()


def reported(tracker) -> tuple[int, int] | None:
    found = tracker.dht.get(tracker.training_progress_key, latest=True)
    if found is None or not found.value:
        return None
    (entry,) = found.value.values()
    return entry.value["epoch"], entry.value["samples_accumulated"]


def test_mini_steps_within_a_period_are_reported_once_and_a_new_epoch_at_once(tracker):
    tracker.report_local_progress(0, 16)
    wait_for(lambda: reported(tracker) == (0, 16), 10, "the first report")
    started = time.monotonic()
    for step in range(2, 51):
        tracker.report_local_progress(0, 16 * step)
    time.sleep(0.5)
    if time.monotonic() - started < PERIOD:  # still inside the period: the 49 mini-steps stored nothing
        assert reported(tracker) == (0, 16)
    tracker.report_local_progress(1, 0)  # a new epoch is news: reported without waiting for the period
    wait_for(lambda: reported(tracker) == (1, 0), PERIOD / 2, "the new epoch's report")
    time.sleep(PERIOD)
    tracker.report_local_progress(1, 32)  # past the period, the next mini-step reports again
    wait_for(lambda: reported(tracker) == (1, 32), 10, "the report after the period")
