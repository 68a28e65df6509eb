"""The soak checker's RSS figures (``bench.soak.rss_growth``): growth after warm-up, per process tree and per part."""

from __future__ import annotations

from bench import soak

MINUTE = 60.0


def series(name: str, pid: int, start: float, minutes: int, main, p2pd=lambda m: 0) -> list[dict]:
    """A process tree sampled every minute from ``start``, its parts' RSS (MiB) as functions of the minute."""
    return [dict(at=start + m * MINUTE, process=name, pid=pid, rss=(main(m) + p2pd(m)) * 2**20,
                 parts={"main": main(m) * 2**20, "p2pd": p2pd(m) * 2**20, "children": 0}) for m in range(minutes)]


def test_growth_is_fitted_after_the_warm_up_per_hour_over_the_mean():
    # 100 MiB flat for 30 minutes against one growing 1 MiB a minute (60 MiB an hour over a mean near 100 + 19)
    flat = series("coordinator", 1, 0.0, 30, lambda m: 100)
    growing = series("worker a", 2, 0.0, 30, lambda m: 100 + m)
    growth = soak.rss_growth(flat + growing, 0.0, 30 * MINUTE)
    assert growth["coordinator"] == 0.0
    assert 0.45 < growth["worker a"] < 0.55, growth  # 60 / ~118.5


def test_a_restarted_process_start_up_is_not_growth():
    # the portal restarted at minute 10: its new instance grows fast for its own first minutes, then holds
    first = series("portal", 1, 0.0, 10, lambda m: 100)
    second = series("portal", 2, 10 * MINUTE, 20, lambda m: 60 + min(m, 6) * 7)
    assert soak.rss_growth(first + second, 0.0, 30 * MINUTE)["portal"] == 0.0
    # the control: with a warm-up of a second, the same instance's start-up reads as growth
    assert soak.rss_growth(second, 10 * MINUTE, 4.0)["portal"] > 0.1


def test_the_part_that_grows_is_named():
    worker = series("worker a", 1, 0.0, 30, lambda m: 300, p2pd=lambda m: 40 + m)
    by_part = soak.rss_growth_by_part(worker, 0.0, 30 * MINUTE)
    assert by_part["worker a: main"] == 0.0 and by_part["worker a: p2pd"] > 0.5, by_part
    assert "worker a: children" not in by_part  # a part the tree does not have


def test_a_fit_over_less_than_a_warm_up_gives_no_figure():
    # a worker that lived from minute 11 to 21 of 30: three samples past its own warm-up, two minutes apart
    short = series("worker b", 1, 11 * MINUTE, 11, lambda m: 430 + (m >= 8) * (m - 7) * 3)
    assert soak.rss_growth(short, 0.0, 30 * MINUTE)["worker b"] is None
    # the control: the same worker living to the end has a figure
    whole = series("worker b", 1, 11 * MINUTE, 19, lambda m: 430 + (m >= 8) * (m - 7) * 3)
    assert soak.rss_growth(whole, 0.0, 30 * MINUTE)["worker b"] > 0.1
