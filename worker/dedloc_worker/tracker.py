"""Reporting this peer's progress to the swarm at a bounded rate.

hivemind's ``ProgressTracker`` stores this peer's progress in the DHT after every mini-step: a signed record and
signed RPCs to the nodes that hold it (about 4.5 CPU-ms each here, without admission's signatures), as fast as the
DHT process can do them. With mini-steps of ~10 ms that took half a core the training could use
(docs/benchmarks.md#where-a-swarm-spends-its-cpu). Peers already extrapolate each other's progress between reports
from the samples per second each report carries, so reporting every ``min_refresh_period`` seconds loses nothing.
"""

from __future__ import annotations

import threading

from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time


class _Doorbell(threading.Event):
    """The tracker's "report now" event; ``set`` does nothing while ``muted``. hivemind's reporter stores on every
    wake-up, so a report can only be skipped by not waking it."""

    muted = False

    def set(self) -> None:
        if not self.muted:
            super().set()


class ThrottledProgressTracker(ProgressTracker):
    """``ProgressTracker`` that reports at most every ``min_refresh_period`` seconds, and at once when this peer's
    epoch changes or its samples go down (a new epoch, a reset after an overflow or a state download)."""

    def __init__(self, *args, start: bool, **kwargs):
        super().__init__(*args, start=False, **kwargs)
        self.should_report_progress = _Doorbell()
        self._last_reported = (-1, 0, float("-inf"))  # (epoch, samples, DHT time) of the last report let through
        if start:
            self.start()

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        epoch, samples, at = self._last_reported
        now = get_dht_time()
        quiet = local_epoch == epoch and samples_accumulated >= samples and now - at < self.min_refresh_period
        if not quiet:
            self._last_reported = (local_epoch, samples_accumulated, now)
        self.should_report_progress.muted = quiet
        try:
            super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        finally:
            self.should_report_progress.muted = False
