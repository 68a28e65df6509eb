"""The run's status (``GET /api/v1/runs/{slug}/status``, the run page's section, the join API's notice), served by
the real app on a migrated database, as coordinators start, beat, stop and crash."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from importlib.metadata import version

import pytest
from dedloc_common.contract import in_utc
from fastapi.testclient import TestClient
from markupsafe import escape

from app.core.clock import utcnow
from app.core.config import Settings
from app.models import Coordinator
from app.runs import registry
from app.runs.snapshots import record_snapshot
from app.web.main import create_app
from tests.support.browsers import needs_chromium

TIMEOUT = 30.0  # the portal's coordinator timeout, seconds


@pytest.fixture
def client(database_url, sessions, tmp_path):
    with sessions() as session:
        registry.create_run(session, slug="demo", title="Demo run")
    with TestClient(create_app(Settings(database_url=database_url, data_dir=tmp_path,
                                        coordinator_timeout=TIMEOUT))) as client:
        yield client


def status(client) -> dict:
    response = client.get("/api/v1/runs/demo/status")
    assert response.status_code == 200, response.text
    return response.json()


def test_status_follows_coordinators_up_stopped_and_crashed(client, sessions):
    before = status(client)
    assert (before["coordinators_up"], before["coordinators"]) == (0, [])
    assert "no coordinator of run 'demo' has started yet" in before["notice"]
    assert before["portal_version"] == version("dedloc")
    join = client.get("/api/v1/runs/demo/join").json()
    assert join["initial_peers"] == [] and join["notice"] == before["notice"]

    with sessions() as session:
        run = registry.get_run(session, "demo")
        first = registry.register_coordinator(session, run, "QmFirst", ["/ip4/10.0.0.1/tcp/1/p2p/QmFirst"]).id
        second = registry.register_coordinator(session, run, "QmSecond", ["/dns4/swarm.example.org/tcp/2/p2p/QmSecond"])
        record_snapshot(session, run, peers_online=5, peers_client=1, peers_unreachable=2, samples_per_second=1.0,
                        epoch=3, loss=None, samples_total=0)
    up = status(client)
    assert up["coordinators_up"] == 2 and up["notice"] is None
    assert {c["peer_id"]: c["up"] for c in up["coordinators"]} == {"QmFirst": True, "QmSecond": True}
    assert {k: up["peers"][k] for k in ("online", "reachable", "unreachable", "client")} == {
        "online": 5, "reachable": 2, "unreachable": 2, "client": 1}
    join = client.get("/api/v1/runs/demo/join").json()
    assert join["notice"] is None and "/dns4/swarm.example.org/tcp/2/p2p/QmSecond" in join["initial_peers"]

    with sessions() as session:
        registry.heartbeat(session, first, alive=False)  # a clean stop
        crashed = session.get(Coordinator, second.id)  # a crash: its heartbeat only ages
        crashed.heartbeat_at = utcnow() - timedelta(seconds=TIMEOUT + 5)
        session.commit()
    down = status(client)
    assert down["coordinators_up"] == 0
    by_id = {c["peer_id"]: c for c in down["coordinators"]}
    assert not by_id["QmFirst"]["up"] and by_id["QmFirst"]["stopped_at"] is not None
    assert by_id["QmFirst"]["last_heartbeat"] == up["coordinators"][[c["peer_id"] for c in up["coordinators"]].index(
        "QmFirst")]["last_heartbeat"], "a clean stop keeps the last heartbeat"
    assert not by_id["QmSecond"]["up"] and by_id["QmSecond"]["stopped_at"] is None
    assert "no coordinator of run 'demo' is up (last heartbeat" in down["notice"]
    join = client.get("/api/v1/runs/demo/join").json()
    assert join["initial_peers"] == [] and join["notice"].startswith("no coordinator of run 'demo' is up")

    page = client.get("/runs/demo").text
    assert 'id="status-coordinators"' in page and ">down<" in page and ">up<" not in page
    assert str(escape(down["notice"].split(" (")[0])) in page

    with sessions() as session:
        registry.register_coordinator(session, registry.get_run(session, "demo"), "QmFirst", ["/ip4/10.0.0.1/tcp/1"])
    back = status(client)
    assert back["coordinators_up"] == 1 and back["notice"] is None
    assert ">up<" in client.get("/runs/demo").text


def as_of(page: str) -> str | None:
    """The status section's "as of" time, or None while that line is hidden."""
    match = re.search(r'<span id="status-as-of"( hidden)?> as of\s*<span id="status-seen-at">([^<]*)</span>', page)
    assert match, "the status section has no as-of line"
    return None if match.group(1) else match.group(2)


def test_with_no_coordinator_up_the_peer_counts_say_from_when(client, sessions):
    page = client.get("/runs/demo").text
    assert as_of(page) is None, "no snapshot yet: nothing to date"
    with sessions() as session:
        run = registry.get_run(session, "demo")
        coordinator = registry.register_coordinator(session, run, "QmOnly", ["/ip4/10.0.0.1/tcp/1/p2p/QmOnly"]).id
        snapshot = record_snapshot(session, run, peers_online=3, peers_client=0, peers_unreachable=1,
                                   samples_per_second=1.0, epoch=2, loss=None, samples_total=0)
        taken_at = in_utc(snapshot.taken_at)
    up = status(client)
    assert datetime.fromisoformat(up["peers"]["seen_at"]) == taken_at
    assert as_of(client.get("/runs/demo").text) is None, "a coordinator is up: the counts are current"

    with sessions() as session:
        session.get(Coordinator, coordinator).heartbeat_at = utcnow() - timedelta(seconds=TIMEOUT + 5)
        session.commit()
    down = status(client)
    assert down["coordinators_up"] == 0 and down["peers"]["online"] == 3
    assert as_of(client.get("/runs/demo").text) == taken_at.strftime("%Y-%m-%d %H:%M:%S UTC")


@needs_chromium
def test_the_status_section_dates_its_counts_once_the_coordinator_is_gone_without_a_reload(start_portal, page):
    portal = start_portal(coordinator_timeout=TIMEOUT)
    with portal.db() as session:
        run = registry.create_run(session, slug="live", title="Live run")
        coordinator = registry.register_coordinator(session, run, "QmLive", ["/ip4/10.0.0.1/tcp/1/p2p/QmLive"]).id
        taken_at = in_utc(record_snapshot(session, run, peers_online=2, peers_client=1, peers_unreachable=0,
                                          samples_per_second=1.0, epoch=1, loss=None, samples_total=0).taken_at)
    page.goto(f"{portal.url}/runs/live")
    assert page.locator("#status-as-of").is_hidden() and page.locator("#status-online").inner_text() == "2"
    with portal.db() as session:
        session.get(Coordinator, coordinator).heartbeat_at = utcnow() - timedelta(seconds=TIMEOUT + 5)
        session.commit()
    page.wait_for_selector("#status-as-of", state="visible", timeout=15_000)  # status.js polls every 5 s
    assert page.locator("#status-seen-at").inner_text() == taken_at.strftime("%Y-%m-%d %H:%M:%S UTC")
    assert page.locator("#status-coordinators tbody td.down").count() == 1


def test_the_join_page_says_how_reachability_is_decided(client):
    page = client.get("/runs/demo/join").text
    assert 'id="reachability"' in page and "asks the portal to dial it back" in page
    assert "--no-client" in page and "status" in page


def test_status_of_an_unknown_run_is_a_404(client):
    response = client.get("/api/v1/runs/nope/status")
    assert response.status_code == 404 and "nope" in response.text


def test_the_join_page_shows_what_the_run_needs_in_memory_as_its_workers_measured_it(client, sessions):
    """Each worker's metrics record carries what it measured before joining (contract.MemoryReport); the coordinator
    keeps it per peer and the join page shows the newest per kind of device. Before any report, it says so."""
    from dedloc_common.contract import MemoryReport, MetricsRecord

    from app.credit.ledger import SignedMetrics
    from app.credit.settlement import record_peers

    assert 'id="memory-needs-none"' in client.get("/runs/demo/join").text  # no report yet: nothing claimed
    gib, mib = 1024**3, 1024**2
    reports = {
        "a" * 64: MemoryReport(device="cuda", precision="bfloat16", model_bytes=3 * gib, fixed_bytes=0,
                               per_sample_bytes=40 * mib, peak_bytes=int(3.5 * gib), micro_batch=8),
        "b" * 64: MemoryReport(device="cpu", model_bytes=gib, host_bytes=2 * gib, per_sample_bytes=80 * mib,
                               peak_bytes=int(1.25 * gib), micro_batch=4),
        "c" * 64: None,  # an auxiliary peer, or an older worker: no report
    }
    with sessions() as session:
        run = registry.get_run(session, "demo")
        record_peers(session, run, [SignedMetrics(key, MetricsRecord(
            username="alice", epoch=1, samples_per_second=1.0, time=0.0, recent=[], memory=memory))
            for key, memory in reports.items()], {})
        session.commit()
    page = client.get("/runs/demo/join").text
    assert 'id="memory-needs"' in page and 'id="memory-needs-none"' not in page
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td>\s*<td>(.*?)</td>", page)
    assert rows == [("a GPU (bfloat16)", "3.00 GiB", "40.0 MiB", "3.50 GiB at 8 samples", "none"),
                    ("a CPU (float32)", "1.00 GiB", "80.0 MiB", "1.25 GiB at 4 samples", "2.00 GiB of RAM")]
