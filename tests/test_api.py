"""The portal's public JSON API and pages, served by the real app on a migrated database."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.runs import registry
from app.runs.snapshots import record_snapshot
from app.web.main import create_app
from tests.support.factories import contribution, seed_credit


@pytest.fixture
def client(database_url, sessions, tmp_path):
    with sessions() as session:
        run = registry.create_run(session, slug="demo", title="Demo run", target_batch_size=4096)
        seed_credit(session, run, "k1", "alice", contribution(0, 300), contribution(1, 200))
        seed_credit(session, run, "k2", "bob", contribution(1, 700))
        start = datetime.now(timezone.utc) - timedelta(minutes=5)
        for i in range(3):
            record_snapshot(session, run, taken_at=start + timedelta(seconds=10 * i), peers_online=2,
                            samples_per_second=100.0 + i, epoch=i, loss=5.0 - i, samples_total=400 * i,
                            samples_accumulated=10 * i, eta_seconds=3.0)
    settings = Settings(database_url=database_url, data_dir=tmp_path)
    with TestClient(create_app(settings)) as client:
        yield client


def test_health_and_runs(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    [run] = client.get("/api/v1/runs").json()
    assert (run["slug"], run["title"], run["task"], run["target_batch_size"]) == ("demo", "Demo run", "tiny-lm", 4096)


def test_swarm_is_the_newest_snapshot(client):
    swarm = client.get("/api/v1/runs/demo/swarm").json()
    assert (swarm["peers_online"], swarm["epoch"], swarm["loss"], swarm["samples_total"]) == (2, 2, 3.0, 800)
    assert swarm["target_batch_size"] == 4096 and swarm["samples_per_second"] == 102.0
    assert datetime.fromisoformat(swarm["updated_at"]).tzinfo is not None


def test_history_is_oldest_first_and_limited(client):
    history = client.get("/api/v1/runs/demo/history").json()
    assert [point["epoch"] for point in history] == [0, 1, 2]
    assert [point["epoch"] for point in client.get("/api/v1/runs/demo/history?limit=2").json()] == [1, 2]
    since = history[0]["updated_at"]
    assert [p["epoch"] for p in client.get("/api/v1/runs/demo/history", params={"since": since}).json()] == [1, 2]


def test_leaderboard_most_samples_first(client):
    board = client.get("/api/v1/runs/demo/leaderboard").json()
    assert [(row["username"], row["samples"]) for row in board] == [("bob", 700), ("alice", 500)]
    assert board[1]["runtime_seconds"] == 3.0


def test_join_info_offers_only_live_coordinators(client, sessions):
    info = client.get("/api/v1/runs/demo/join").json()
    assert info["initial_peers"] == [] and info["config"]["target_batch_size"] == 4096
    with sessions() as session:
        registry.register_coordinator(session, registry.get_run(session, "demo"), "QmPeer",
                                      ["/ip4/127.0.0.1/tcp/1/p2p/QmPeer"])
    assert client.get("/api/v1/runs/demo/join").json()["initial_peers"] == ["/ip4/127.0.0.1/tcp/1/p2p/QmPeer"]


@pytest.mark.parametrize("path", ["/api/v1/runs/nope/swarm", "/api/v1/runs/nope/history",
                                  "/api/v1/runs/nope/leaderboard",
                                  "/api/v1/runs/nope/join", "/api/v1/runs/nope"])
def test_unknown_run_is_a_404_with_a_reason(client, path):
    response = client.get(path)
    assert response.status_code == 404
    assert response.json() == {"detail": "no run named 'nope'"}


@pytest.mark.parametrize("query", ["limit=0", "limit=abc", "limit=100000", "since=yesterday"])
def test_bad_query_values_are_a_422_with_a_reason(client, query):
    response = client.get(f"/api/v1/runs/demo/history?{query}")
    assert response.status_code == 422
    reason = response.json()["detail"]
    assert isinstance(reason, str) and reason.split(":")[0] in {"query.limit", "query.since"}


def test_a_slug_too_long_is_refused_not_crashed(client):
    assert client.get("/api/v1/runs/" + "x" * 500 + "/swarm").status_code == 422


def test_pages_render_the_run(client):
    home = client.get("/")
    assert home.status_code == 200 and "Demo run" in home.text and "800 samples" in home.text
    dashboard = client.get("/runs/demo")
    assert dashboard.status_code == 200 and 'id="samples_total"' in dashboard.text and "alice" in dashboard.text
    board = client.get("/runs/demo/leaderboard")
    assert board.text.index("bob") < board.text.index("alice")


def test_an_unknown_page_is_a_readable_404(client):
    page = client.get("/runs/nope", headers={"accept": "text/html"})
    assert page.status_code == 404 and "no run named" in page.text and "<html" in page.text


def test_metrics_are_prometheus_text_per_run(client):
    text = client.get("/metrics").text
    assert 'dedloc_peers_online{run="demo"} 2.0' in text
    assert 'dedloc_samples_total{run="demo"} 800.0' in text
    assert "# TYPE dedloc_epoch gauge" in text


def test_the_web_app_never_imports_torch_or_hivemind():
    code = ("import sys; from app.web.main import create_app; create_app(); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'hivemind')); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_worker_never_imports_the_portal():
    code = ("import sys, dedloc_worker.cli, dedloc_worker.training.loop, dedloc_worker.portal.client; "
            "print(sorted(m for m in sys.modules if m == 'app' or m.startswith('app.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_notebook_asks_colab_and_kaggle_for_a_gpu_and_joins_in_the_automatic_mode(client):
    from dedloc_worker.cli import build_parser

    notebook = client.get("/runs/demo/join.ipynb").json()
    assert notebook["metadata"]["colab"]["gpuType"] and notebook["metadata"]["kaggle"]["isGpuEnabled"] is True
    check, install, join = (cell["source"] for cell in notebook["cells"] if cell["cell_type"] == "code")
    compile(check, "gpu-check", "exec")  # the GPU check is Python that runs
    assert install.startswith("!pip install ") and ".whl" in install
    args = build_parser().parse_args(join.removeprefix("!dedloc-worker ").split())
    assert args.run == "demo" and args.device == "auto" and args.client is None  # reachability decided at join
