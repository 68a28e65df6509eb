"""Reporting this peer's progress to the swarm only when the others' estimate of it would be wrong.

hivemind's ``ProgressTracker`` stores this peer's progress in the DHT after every mini-step: a signed record and
signed RPCs to the nodes that hold it, as fast as the DHT process can do them. With mini-steps of ~10 ms that took
half a core the training could use (docs/benchmarks.md#where-a-swarm-spends-its-cpu). But peers already extrapolate
each other's progress between reports from the samples per second each report carries (samples + rate x time since
the report), so a report is news only when that extrapolation has drifted: dead reckoning, as in networked games.
The rate a report carries is averaged over seconds of training (``SteadyRate``), so that the extrapolation holds.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Optional

from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.utils import get_dht_time
from hivemind.utils.performance_ema import PerformanceEMA

DRIFT = 0.02  # of the global batch: how far the others' extrapolation of this peer may be off before it reports
SLACK = 0.1  # of what the swarm has left of its epoch: how far it may be off earlier in the epoch (``allowed_drift``)
RATE_SECONDS = 10.0  # the span of training a peer's reported samples per second average over


class SteadyRate(PerformanceEMA):
    """Samples per second over about the last ``seconds`` of training: samples and time both weighted by
    exp(-age / seconds). hivemind's ``PerformanceEMA`` averages the last ~10 updates, a fifth of a second of mini-steps
    here, so with delayed updates (slower while the last step ends in the background) the rate a report carried
    swung between ~100 and ~700 samples/s within an epoch, the others' extrapolation drifted, and each peer reported
    about three times an epoch. The first update only starts the clock: its interval holds the start-up."""

    def __init__(self, seconds: float = RATE_SECONDS):
        super().__init__()
        self.seconds = seconds
        self._samples = self._elapsed = 0.0
        self._started = False

    def update(self, task_size: float, interval: Optional[float] = None) -> float:
        assert task_size > 0, f"Can't register processing {task_size} samples"
        if not self.paused:
            self.timestamp, before = time.perf_counter(), self.timestamp
            interval = interval if interval is not None else self.timestamp - before
        interval = max(interval or 0.0, 0.0)  # paused without one: no time counted
        if not self._started:
            self._started = True
            return self.samples_per_second
        keep = math.exp(-interval / self.seconds)
        self._samples = self._samples * keep + task_size
        self._elapsed = self._elapsed * keep + interval
        self.num_updates += 1
        self.ema_seconds_per_sample = self._elapsed / self._samples
        self.samples_per_second = self._samples / max(self._elapsed, self.eps)
        return self.samples_per_second


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
    go down (a reset after an overflow or a state download); otherwise, never twice within ``min_refresh_period``
    seconds, once its rate is first measured (the first report carries none) and when its samples are more than
    ``allowed_drift`` off what the others extrapolate from its last report.
    hivemind's reporter still renews the record before it expires.

    :param tolerance: samples, the drift allowed near an epoch's end; by default ``DRIFT`` of the global batch
    :param slack: the share of the swarm's samples left in the epoch that may drift before it (``allowed_drift``)
    :ivar others_samples_per_second: the rates the other peers' records carried at the last read of the swarm's
      progress, summed (0 before it)
    """

    others_samples_per_second = 0.0

    def __init__(self, *args, start: bool, tolerance: float | None = None, slack: float = SLACK, **kwargs):
        super().__init__(*args, start=False, **kwargs)
        self.performance_ema = SteadyRate()
        self.should_report_progress = _Doorbell()
        self.tolerance = tolerance if tolerance is not None else max(1.0, DRIFT * self.target_batch_size)
        self.slack = slack
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

    def allowed_drift(self) -> float:
        """Samples the others' extrapolation of this peer may be off by now. Only their estimate as the epoch ends
        decides when it ends, and a deviation early in it has time to even out (with delayed updates a peer is
        slower while its last step ends in the background, faster after: about 100 samples either way of a
        4,096-sample epoch, each worth a report at ``tolerance``), so early on it may be ``slack`` of what the swarm
        has left to accumulate: the time to the epoch's end as this peer last estimated it, at the swarm's rate."""
        seconds_left = self.global_progress.eta_next_epoch - get_dht_time()
        left = self.target_batch_size if not math.isfinite(seconds_left) else \
            min(self.target_batch_size, max(0.0, seconds_left) * self.swarm_samples_per_second)
        return max(self.tolerance, self.slack * left)

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        last, now = self._last_reported, get_dht_time()
        if local_epoch != last.epoch:
            # hivemind stores a record only for a peer whose last report with samples was in the previous epoch
            # or this one (others are aux peers). A peer that kept its pace reported no samples in its epoch, so
            # the 0 of a new epoch would not be stored: the others would miss its samples and overshoot the batch.
            quiet = samples_accumulated == 0
        else:
            ema = self.performance_ema
            first_rate = last.rate <= ema.eps < ema.samples_per_second  # the last report had none measured yet
            due = now - last.at >= self.min_refresh_period and (
                first_rate or abs(samples_accumulated - last.predicts(now)) > self.allowed_drift())
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
