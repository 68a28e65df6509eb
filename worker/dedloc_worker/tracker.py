"""Reporting this peer's progress to the swarm only when the others' estimate of it would be wrong.

hivemind's ``ProgressTracker`` stores this peer's progress in the DHT after every mini-step: a signed record and
signed RPCs to the nodes that hold it, as fast as the DHT process can do them. With mini-steps of ~10 ms that took
half a core the training could use (docs/benchmarks.md#where-a-swarm-spends-its-cpu). But peers already extrapolate
each other's progress between reports from the samples per second each report carries (samples + rate x time since
the report), so a report is news only when that extrapolation has drifted: dead reckoning, as in networked games.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.utils import get_dht_time

DRIFT = 0.02  # of the global batch: how far the others' extrapolation of this peer may be off before it reports


class _Doorbell(threading.Event):
    """The tracker's "report now" event; ``set`` does nothing while ``muted``. hivemind's reporter stores on every
    wake-up, so a report can only be skipped by not waking it."""

    muted = False

    def set(self) -> None:
        if not self.muted:
            super().set()


@dataclass(frozen=True)
class _Report:
    epoch: int
    samples: int
    at: float  # DHT time
    rate: float  # samples per second, as the report carried them

    def predicts(self, now: float) -> float:
        """What a peer reading this report estimates this peer's samples to be at ``now``."""
        return self.samples + max(0.0, now - self.at) * self.rate


class ThrottledProgressTracker(ProgressTracker):
    """``ProgressTracker`` that reports at once when this peer has its first samples of a new epoch or its samples
    go down (a reset after an overflow or a state download); otherwise only when its samples are more than
    ``tolerance`` off what the others extrapolate from its last report, and never twice within
    ``min_refresh_period`` seconds.
    hivemind's reporter still renews the record before it expires.

    :param tolerance: samples; by default ``DRIFT`` of the global batch
    :ivar others_samples_per_second: the rates the other peers' records carried at the last read of the swarm's
      progress, summed (0 before it)
    """

    others_samples_per_second = 0.0

    def __init__(self, *args, start: bool, tolerance: float | None = None, **kwargs):
        super().__init__(*args, start=False, **kwargs)
        self.should_report_progress = _Doorbell()
        self.tolerance = tolerance if tolerance is not None else max(1.0, DRIFT * self.target_batch_size)
        self._last_reported = _Report(-1, 0, float("-inf"), 0.0)
        if start:
            self.start()

    @property
    def swarm_samples_per_second(self) -> float:
        """What the collaboration trains per second: the others' reported rates and this peer's own, as it stands
        (its record's rate is as old as its last report)."""
        return self.others_samples_per_second + self.performance_ema.samples_per_second

    def _parse_swarm_progress_data(self, metadata):
        progress = super()._parse_swarm_progress_data(metadata)
        others = metadata.items() if isinstance(metadata, dict) else ()
        self.others_samples_per_second = sum(LocalTrainingProgress.parse_obj(entry.value).samples_per_second
                                             for subkey, entry in others
                                             if subkey != self._local_public_key and entry.value is not None)
        return progress

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        last, now = self._last_reported, get_dht_time()
        if local_epoch != last.epoch:
            # hivemind stores a record only for a peer whose last report with samples was in the previous epoch
            # or this one (others are aux peers). A peer that kept its pace reported no samples in its epoch, so
            # the 0 of a new epoch would not be stored: the others would miss its samples and overshoot the batch.
            quiet = samples_accumulated == 0
        else:
            due = now - last.at >= self.min_refresh_period and \
                abs(samples_accumulated - last.predicts(now)) > self.tolerance
            quiet = not (samples_accumulated < last.samples or due)
        self.should_report_progress.muted = quiet
        try:
            super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        finally:
            self.should_report_progress.muted = False
        if not quiet:
            progress = self.local_progress
            self._last_reported = _Report(progress.epoch, progress.samples_accumulated, progress.time,
                                          progress.samples_per_second)
