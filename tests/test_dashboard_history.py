"""The dashboard shows the whole run: history drawn when the page opens (a real browser), evaluations kept when
archives are pruned, and the round model fitted from measured rounds."""

from __future__ import annotations

import statistics
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from app.models import Snapshot
from app.planner import PeerProfile, RoundCosts, RoundObservation, fit_round_costs, plan_averaging, round_seconds
from app.runs import checkpoints, registry
from tests.support.browsers import needs_chromium

PART = 2**17


def test_evaluations_survive_pruning(start_portal, tmp_path):
    portal = start_portal()  # its data_dir is tmp_path
    with portal.db() as session:
        run = registry.create_run(session, slug="evals", title="Evaluated")
        folder = checkpoints.checkpoints_dir(tmp_path, run.slug)
        folder.mkdir(parents=True)
        for i, epoch in enumerate((10, 20, 30, 40, 50)):
            name = f"epoch-{epoch:06d}.tar"
            (folder / name).write_bytes(b"archive")
            checkpoints.store_archive(session, tmp_path, run, epoch=epoch, samples=epoch * 100, eval_loss=5.0 - i,
                                      sha256="0" * 64, size=7, file_name=name, final=False, keep=2)
            session.commit()
    kept = httpx.get(f"{portal.url}/api/v1/runs/evals/checkpoints").json()
    series = httpx.get(f"{portal.url}/api/v1/runs/evals/evaluations").json()
    assert [c["epoch"] for c in kept] == [50, 40]  # pruning kept two archives ...
    assert [(e["epoch"], e["eval_loss"]) for e in series] == [(10, 5.0), (20, 4.0), (30, 3.0), (40, 2.0), (50, 1.0)]
    assert sorted(p.name for p in folder.iterdir()) == ["epoch-000040.tar", "epoch-000050.tar"]
    assert httpx.get(f"{portal.url}/api/v1/runs/nope/evaluations").status_code == 404


@needs_chromium
def test_the_dashboard_opened_once_shows_the_whole_hour(start_portal, chromium_browser, output_dir):
    portal = start_portal()
    now = datetime.now(timezone.utc)
    with portal.db() as session:
        run = registry.create_run(session, slug="hour", title="An hour of training")
        for i in range(361):  # an hour, a snapshot every 10 s, the loss falling from 10 to 6.4
            session.add(Snapshot(run_id=run.id, taken_at=now - timedelta(seconds=3600 - 10 * i), peers_online=2,
                                 samples_per_second=100.0 + i % 7, epoch=i // 6, loss=10.0 - 3.6 * i / 360,
                                 samples_total=i * 1000))
        session.commit()
    page = chromium_browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(f"{portal.url}/runs/hour")
    page.wait_for_function("Chart.getChart('chart-loss').data.datasets[0].data.length > 100", timeout=20_000)
    points = page.evaluate("Chart.getChart('chart-loss').data.datasets[0].data")
    span = (points[-1]["x"] - points[0]["x"]) / 1000
    assert span >= 3500, f"the loss chart spans {span:.0f} s of the hour"
    assert points[0]["y"] == pytest.approx(10.0, abs=0.2) and points[-1]["y"] == pytest.approx(6.4, abs=0.01)
    assert [p["x"] for p in points] == sorted(p["x"] for p in points)
    page.screenshot(path=str(output_dir / "dashboard-hour.png"), full_page=True)
    page.close()


def test_the_fit_recovers_a_rounds_latency_and_per_part_cost():
    latency, per_part, up = 0.25, 0.002, 10e6
    rounds = [RoundObservation(latency + parts * PART / up + parts * per_part, parts * PART, parts * PART / 2, up, up)
              for parts in (4, 8, 16, 32, 64)]
    costs = fit_round_costs(rounds, PART)
    assert costs.rounds == 5
    assert costs.latency_seconds == pytest.approx(latency, rel=1e-6)
    assert costs.part_seconds == pytest.approx(per_part, rel=1e-6)
    assert fit_round_costs([], PART) == RoundCosts()  # no round measured: bandwidth alone


def test_a_round_that_waited_on_a_straggler_moves_the_fit_little():
    """Rounds of 0.2-0.3 s and one of 1.7 s (seen on a loaded machine): the fit stays near the typical round, where
    least squares would predict the mean."""
    typical = [0.2, 0.22, 0.25, 0.27, 0.3, 0.24]
    rounds = [RoundObservation(seconds, PART, PART, 1e9, 1e9) for seconds in typical + [1.7]]
    costs = fit_round_costs(rounds, PART)
    predicted = costs.latency_seconds + costs.part_seconds
    assert 0.2 <= predicted <= 0.3, predicted
    assert predicted < statistics.mean(r.seconds for r in rounds) - 0.1


def test_the_plan_weighs_the_fitted_costs():
    # Two fast aggregators and a slow one: a per-part cost makes bytes dearer on the fast links, so the slow peer
    # takes more of the vector than bandwidth alone gives it; the latency adds to every round.
    peers = [PeerProfile("a", 1, 100e6, 100e6), PeerProfile("b", 1, 100e6, 100e6), PeerProfile("c", 1, 40e6, 40e6)]
    vector = 64 * PART
    costs = RoundCosts(latency_seconds=0.2, part_seconds=0.01, part_bytes=PART, rounds=10)
    alone, fitted = plan_averaging(peers, vector), plan_averaging(peers, vector, costs=costs)
    assert alone.shares["c"] < 0.01 and fitted.shares["c"] > 0.1
    assert fitted.predicted_seconds == pytest.approx(round_seconds(peers, fitted.shares, vector, costs=costs))
    assert fitted.predicted_seconds > alone.predicted_seconds + 0.2
    assert fitted.lower_bound_seconds == alone.lower_bound_seconds  # the bound is bandwidth's alone
