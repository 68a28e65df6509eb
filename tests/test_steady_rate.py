"""The rate a peer's progress reports carry (dedloc_worker.training.tracker.SteadyRate): what the others extrapolate
it with."""

from __future__ import annotations

import time

from dedloc_worker.training.tracker import SteadyRate
from hivemind.utils.performance_ema import PerformanceEMA

SLOW, FAST = 0.05, 0.0125  # seconds per mini-step of 16 samples: 320 and 1,280 samples/s
CYCLE = [SLOW] * 10 + [FAST] * 40  # an epoch with delayed updates: slow while the last step ends, then fast
MEAN = 16 * len(CYCLE) / sum(CYCLE)  # 800 samples/s over the cycle


def readings(ema, cycles: int = 30) -> list[float]:
    """The estimate after each mini-step of the last cycle."""
    seen = []
    for _ in range(cycles):
        seen = [ema.update(16, interval=seconds) for seconds in CYCLE]
    return seen


def test_the_reported_rate_holds_the_mean_pace_of_epochs_whose_pace_changes_within():
    steady = readings(SteadyRate())
    assert all(abs(rate - MEAN) < 0.05 * MEAN for rate in steady), (min(steady), max(steady))
    # hivemind's estimate, the control: it follows each phase, so the others' extrapolation drifts
    hivemind = readings(PerformanceEMA(alpha=0.1))
    assert min(hivemind) < 0.6 * MEAN and max(hivemind) > 1.3 * MEAN, (min(hivemind), max(hivemind))


def test_the_first_interval_holds_the_start_up_and_does_not_count():
    rate = SteadyRate()
    rate.update(16, interval=30.0)  # from building the tracker to the first mini-step: loading, joining
    for _ in range(20):
        rate.update(16, interval=FAST)
    assert abs(rate.samples_per_second - 16 / FAST) < 1e-6 * 16 / FAST
    assert rate.num_updates == 20  # a metrics record tells "not measured yet" by 0 updates


def test_time_spent_paused_is_not_counted():
    """hivemind pauses the estimate while an epoch turns over (its optimizer step): that time is not training."""
    rate = SteadyRate()
    for _ in range(21):
        time.sleep(0.01)
        rate.update(16)
    before = rate.samples_per_second
    with rate.pause():
        time.sleep(0.3)  # counted, it would be more than the 20 mini-steps' time together
    time.sleep(0.01)
    rate.update(16)
    assert rate.samples_per_second > 0.8 * before, (before, rate.samples_per_second)
