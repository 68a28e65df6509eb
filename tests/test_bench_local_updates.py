"""The local-updates bench's bookkeeping (``bench.local_updates.measure``) on peer records whose figures are known.

No peers start here; the bench itself (``make bench``) runs the swarms."""

from __future__ import annotations

import pytest

from bench.local_updates import Case, measure

CASE = Case("local-updates", "local-updates", "fp16", epochs=5, skip=1)


def peer(lost_epoch: int | None = None) -> dict:
    """Five rounds, 10 s apart, of 1,000 samples each (0 where this peer's round failed); each closing step lasts
    1.5 s, its round starting 0.5 s in and taking 0.8 s, 3,000 bytes of payload. Counters sampled every second:
    500 bytes sent, 0.8 s computing, 0.2 s in steps and 100 samples trained per second."""
    records, rounds = [], []
    for epoch in range(5):
        end = 100.0 + 10 * epoch
        records.append(dict(epoch=epoch, samples=0 if epoch == lost_epoch else 1000, time=end, step_began=end - 1.5,
                            closing_step=1.5))
        rounds.append(dict(began=end - 1.0, seconds=0.8, sent=3000, received=3000, complete=True, group=2))
    series = [[t, 500.0 * (t - 90), 0.8 * (t - 90), 0.2 * (t - 90), 100.0 * (t - 90)] for t in range(90, 150)]
    return dict(records=records, rounds=rounds, series=series, epoch=5, eval_loss=2.0,
                missed_rounds=int(lost_epoch is not None), began=0.0, ready=3.0, trained=150.0)


def test_a_window_of_whole_rounds_gives_rate_bytes_and_foreground_time():
    row = measure(CASE, [peer(), peer()], solo=400.0, mbit=2.0)
    # the window runs from the end of round 0 to the end of round 4: 4 rounds, 40 s, 8,000 samples
    assert (row["rounds"], row["seconds"], row["samples"]) == (4, 40.0, 8000)
    assert row["efficiency"] == pytest.approx(8000 / 40 / 400)
    assert row["bytes_per_sample"] == pytest.approx(2 * 20000 / 8000)
    assert row["payload_bytes_per_sample"] == pytest.approx(8 * 3000 / 8000)  # round 0's began before the window
    assert row["closing_share"] == pytest.approx(6.0 / 40)
    assert row["between_rounds_efficiency"] == pytest.approx(8000 / 34 / 400, abs=1e-3)
    assert (row["wait_before_round_seconds"], row["after_round_seconds"]) == (0.5, pytest.approx(0.2))
    assert row["lost_samples"] == 0 and row["eval_samples"] == 10000 and row["full_rounds"] == 4


def test_samples_of_a_failed_round_count_as_lost_not_trained():
    row = measure(CASE, [peer(), peer(lost_epoch=3)], solo=400.0, mbit=2.0)
    assert row["samples"] == 7000 and row["lost_samples"] == 1000 and row["missed_rounds"] == 1
    assert row["efficiency"] == pytest.approx(7000 / 40 / 400, abs=1e-3)  # rows keep 3 decimals


def test_epochs_a_peer_skipped_by_taking_the_swarms_state_count_as_lost():
    behind = peer()
    behind["records"] = [r for r in behind["records"] if r["epoch"] not in (2, 3)]  # stuck, then loaded state
    row = measure(CASE, [peer(), behind], solo=400.0, mbit=2.0)
    assert (row["rounds"], row["seconds"], row["samples"], row["lost_samples"]) == (4, 40.0, 6000, 2000)


def test_too_few_rounds_is_an_error_row():
    short = [peer(), peer()]
    for one in short:
        one["records"] = one["records"][:2]
    row = measure(CASE, short, solo=400.0, mbit=2.0)
    assert "only 2 rounds" in row["error"] and "efficiency" not in row
