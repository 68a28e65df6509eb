"""Progress reports only when they are news (dedloc_worker.training.tracker), read back from a real DHT."""

from __future__ import annotations

import gc
import time

import pytest
from dedloc_worker.swarm.node import create_dht
from dedloc_worker.training import tracker as tracker_module
from dedloc_worker.training.tracker import ThrottledProgressTracker
from hivemind.utils import get_dht_time

from tests.support.harness import wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
PERIOD = 2.0  # seconds between two reports of one epoch


class DrivenClock:
    """DHT time as the test sets it (``now``), for the tracker's decisions."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_tracker():
    dht = create_dht([], "/ip4/127.0.0.1/tcp/0", client_mode=False)
    made = []

    def make(target: int = 10**9, **kwargs) -> ThrottledProgressTracker:
        made.append(ThrottledProgressTracker(dht, f"throttle-test-{len(made)}", target, start=True, **kwargs))
        return made[-1]

    try:
        yield make
    finally:
        for tracker in made:
            tracker.shutdown()
        dht.shutdown()
        gc.collect()


def stored(tracker) -> dict | None:
    """The tracker's progress record as the DHT holds it."""
    found = tracker.dht.get(tracker.training_progress_key, latest=True)
    if found is None or not found.value:
        return None
    (entry,) = found.value.values()
    return entry.value


def reported(tracker) -> tuple[int, int] | None:
    record = stored(tracker)
    return None if record is None else (record["epoch"], record["samples_accumulated"])


def test_mini_steps_within_a_period_are_reported_once_and_a_new_epoch_at_once(make_tracker, monkeypatch):
    """The tracker's reading of the time is driven here (hivemind stamps and stores with the real one), so every
    claim holds however slow the machine: the mini-steps are within the period of the first report, and the new
    epoch's report is made while still within it."""
    clock = DrivenClock(get_dht_time())
    monkeypatch.setattr(tracker_module, "get_dht_time", clock)
    # hivemind renews the record every metadata_expiration / 2 seconds, muted or not: not within this test
    tracker = make_tracker(min_refresh_period=PERIOD, tolerance=16, slack=0, metadata_expiration=600)
    sent = time.monotonic()
    tracker.report_local_progress(0, 16)
    wait_for(lambda: reported(tracker) == (0, 16), 10, "the first report")
    landed = time.monotonic() - sent
    clock.now = stored(tracker)["time"]  # held still at the first report's time
    for step in range(2, 51):
        tracker.report_local_progress(0, 16 * step)
    time.sleep(max(0.5, 3 * landed))  # a report, had one been made, lands in what the first one took
    assert reported(tracker) == (0, 16), "a mini-step within the period was reported"
    tracker.report_local_progress(1, 0)
    tracker.report_local_progress(1, 16)  # a new epoch's first samples are news: reported without waiting
    wait_for(lambda: reported(tracker) == (1, 16), 10, "the new epoch's report within the period")
    # the control: past the period, a mini-step far from what the report's rate predicts is reported
    clock.now = get_dht_time() + PERIOD
    tracker.report_local_progress(1, 32)
    wait_for(lambda: reported(tracker) == (1, 32), 10, "the report after the period")


def test_steady_progress_is_not_reported_again_and_a_change_of_pace_is(make_tracker):
    """Readers extrapolate from the last report's rate; while the peer keeps that pace a report would tell them
    nothing, so none is made. A peer that stalls falls behind their estimate and reports at its next mini-step."""
    # 320 samples/s on an absolute schedule (no drift from jitter); 240 samples of tolerance are 0.75 s of lag
    tracker = make_tracker(min_refresh_period=0.1, tolerance=240, slack=0)
    step, batch, start = 0.05, 16, time.monotonic()

    def train(epoch: int, steps: int, first: int = 0) -> int:
        for n in range(first, first + steps):
            time.sleep(max(0.0, start + n * step - time.monotonic()))
            tracker.report_local_progress(epoch, batch * (n + 1 - first))
        return first + steps

    n = train(0, 30)  # the rate settles
    tracker.report_local_progress(1, 0)
    # The schedule goes on at once: readers extrapolate from the report's time, so a pause here would be a stall.
    n = train(1, 40, n) - n  # 2 s at the reported pace
    wait_for(lambda: (reported(tracker) or (0, 0))[0] == 1, 10, "the new epoch's report")
    assert reported(tracker) == (1, batch), "a report while the peer kept the pace it had reported"
    time.sleep(1.5)  # a stall: 480 samples behind what readers extrapolate
    tracker.report_local_progress(1, batch * (n + 1))
    wait_for(lambda: reported(tracker) == (1, batch * (n + 1)), 10, "the report after the stall")


def test_a_lag_early_in_an_epoch_is_let_be_and_one_near_its_end_is_reported(make_tracker):
    """Only the others' estimate as an epoch ends decides when it ends, and a lag early in an epoch (a peer is slower
    while its last step ends in the background) has time to even out: early on a peer may drift by a share of what
    the swarm has left (``slack``), near the end only by ``tolerance``. The control: the same lag at ``slack`` 0 is
    reported in the test above."""
    # 640 samples/s on an absolute schedule: the 4,096-sample epoch takes 6.4 s
    tracker = make_tracker(target=4096, min_refresh_period=0.1, max_refresh_period=0.5, tolerance=40)
    step, batch, clock = 0.025, 16, {"start": time.monotonic(), "paused": 0.0}

    def train(epoch: int, first: int, last: int) -> None:
        for n in range(first, last):
            time.sleep(max(0.0, clock["start"] + clock["paused"] + n * step - time.monotonic()))
            tracker.report_local_progress(epoch, batch * (n + 1))

    def stall(seconds: float) -> None:
        time.sleep(seconds)
        clock["paused"] += seconds

    train(0, 0, 40)  # the rate settles
    tracker.report_local_progress(1, 0)
    clock["start"] = time.monotonic() + step
    train(1, 0, 40)  # 640 samples, 1 s
    wait_for(lambda: reported(tracker) == (1, batch), 10, "the new epoch's report")
    stall(0.3)  # 192 samples behind the estimate, with ~3,400 left: within the slack (~340)
    train(1, 40, 52)
    time.sleep(0.2)
    assert reported(tracker) == (1, batch), "a lag early in the epoch was reported"
    train(1, 52, 230)  # 3,680 samples: near the end the lag is reported, and the estimate meets the samples
    wait_for(lambda: reported(tracker)[1] > batch, 10, "the lag's report as the epoch's end nears")
    stall(0.4)
    train(1, 230, 231)
    wait_for(lambda: reported(tracker) == (1, batch * 231), 10, "the report of a lag near the epoch's end")


def test_a_new_epoch_is_stored_after_an_epoch_at_a_steady_pace(make_tracker):
    """hivemind stores the record of a peer only if it last reported samples in this epoch or the one before (it
    takes others for aux peers). A peer that kept its pace for a whole epoch reported only that epoch's start; had
    that start carried 0 samples, the next epoch's report was dropped, and the others' estimate left out this peer's
    samples until it drifted: epochs overshot the global batch by up to half."""
    tracker = make_tracker(min_refresh_period=0.1, tolerance=240)
    step, batch, start = 0.05, 16, time.monotonic()

    def train(epoch: int, first: int, steps: int) -> int:
        with tracker.pause_updates():
            tracker.update_epoch(epoch)  # as hivemind's optimizer steps: the new epoch with 0 samples
        for n in range(first, first + steps):
            time.sleep(max(0.0, start + n * step - time.monotonic()))
            tracker.report_local_progress(epoch, batch * (n + 1 - first))
        return first + steps

    n = train(1, 0, 20)  # the rate settles
    n = train(2, n, 30)  # 1.5 s at the reported pace: one report, at the epoch's start
    assert reported(tracker)[0] == 2, "the control: the steady epoch's start was stored"
    train(3, n, 10)
    wait_for(lambda: reported(tracker)[0] == 3, 5, "the report of the epoch after a steady one")


def test_the_swarm_rate_shown_adds_the_other_peers_reported_rates_to_this_ones(make_tracker):
    """The worker's line "N samples/s here, M in the swarm" showed this peer's own rate as the swarm's at each new
    epoch (hivemind's ETA is unknown there), so two peers read as one. It is now this peer's rate plus what the other
    peers' records in the DHT say."""
    from types import SimpleNamespace

    from dedloc_worker.training.loop import status_of
    from hivemind.utils.crypto import RSAPrivateKey

    here = make_tracker(min_refresh_period=0.1, max_refresh_period=0.5)
    other = create_dht([str(addr) for addr in here.dht.get_visible_maddrs()], "/ip4/127.0.0.1/tcp/0",
                       client_mode=False)
    # a peer of its own: records are keyed by their signer, and every DHT of one process signs with the same key
    there = ThrottledProgressTracker(other, here.prefix, 10**9, start=True, min_refresh_period=0.1,
                                     max_refresh_period=0.5, private_key=RSAPrivateKey())
    try:
        for tracker, pause in ((here, 0.02), (there, 0.05)):  # two paces: two different rates
            for step in range(1, 11):
                time.sleep(pause)
                tracker.report_local_progress(0, 16 * step)

        def stored() -> dict:
            found = here.dht.get(here.training_progress_key, latest=True)
            return {} if found is None else {subkey: entry.value["samples_per_second"]
                                             for subkey, entry in found.value.items()}

        wait_for(lambda: len(stored()) == 2, 10, "both peers' records")
        theirs = stored()[there._local_public_key]  # the subkey hivemind's tracker stores its record under
        assert theirs > 0

        def shown() -> float:  # what the worker's line and bar show
            return status_of(SimpleNamespace(tracker=here, local_epoch=0), None).swarm_samples_per_second

        wait_for(lambda: abs(shown() - (theirs + here.performance_ema.samples_per_second)) < 1e-6, 10,
                 f"the swarm rate shown to add the other peer's {theirs:.1f} samples/s to this one's")
        assert shown() > max(theirs, here.performance_ema.samples_per_second)
    finally:
        there.shutdown()
        other.shutdown()
