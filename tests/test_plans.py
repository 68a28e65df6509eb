"""Averaging plans on the real app and a migrated database (SQLite and PostgreSQL): the public plan API, the plan
on the run dashboard, and the link probes workers time to measure their bandwidth."""

from __future__ import annotations

import asyncio
import zlib
from datetime import datetime, timedelta, timezone

import pytest
from dedloc_common.contract import LINK_PROBE_MAX_BYTES
from fastapi.testclient import TestClient
from starlette.requests import Request

from app.core.config import Settings
from app.core.errors import TooLarge
from app.identity.accounts import issue_credential, sign_in_locally
from app.identity.models import User
from app.models import AveragingPlan
from app.runs import plans, registry
from app.runs.fingerprints import fingerprint
from app.web.link_probe import count_body
from app.web.main import create_app
from tests.support.factories import ALICE_KEY

# Base58 PeerIDs as hivemind prints them; each is searched for whole in every answer.
ALICE_PEER = "12D3KooWGzh9Uj6ytb4DLwCVWcEq5S2Nw1P8yAJdbSx7JmvXyG3a"
BOB_AUX_PEER = "12D3KooWRq8hVEBxv3TwJmY4fDzLkP2cN5sA7gU9WnHbXe6KtQpZ"
CAROL_PEER = "12D3KooWMxT4pLq9ZcVb2N8jRwYh3Gk6Ds5Fe7Au1CnHoJiKyBtE"
HIDDEN_NAME = "carol-hidden"
PLANNED_AT = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)
MBIT = 1e6 / 8  # bytes per second


def plan_row(run, predicted: float, created_at: datetime) -> AveragingPlan:
    """alice aggregates 62.5 % at 100/200 Mbit/s, bob's auxiliary peer 37.5 % at 50/50, the hidden carol is a
    client at 10/20 Mbit/s (the portal found her unreachable)."""
    peers = [
        {"peer_id": CAROL_PEER, "username": HIDDEN_NAME, "share": 0.0, "role": "client",
         "upload_bps": 10 * MBIT, "download_bps": 20 * MBIT, "reachability": "unreachable"},
        {"peer_id": ALICE_PEER, "username": "alice", "share": 0.625, "role": "aggregator",
         "upload_bps": 100 * MBIT, "download_bps": 200 * MBIT, "device": "cuda"},
        {"peer_id": BOB_AUX_PEER, "username": "bob", "share": 0.375, "role": "aux",
         "upload_bps": 50 * MBIT, "download_bps": 50 * MBIT},
    ]
    return AveragingPlan(run_id=run.id, created_at=created_at, peers=peers, vector_bytes=40_000_000,
                         predicted_seconds=predicted, lower_bound_seconds=0.8, measured_seconds=1.5,
                         reason="a peer joined")


@pytest.fixture
def app(database_url, sessions, tmp_path):
    """Run "demo" with an outdated plan and the current one; run "quiet" with none; alice holds a credential."""
    with sessions() as session:
        demo = registry.create_run(session, slug="demo", title="Demo run")
        registry.create_run(session, slug="quiet", title="Quiet run")
        session.add_all([User(username="bob"), User(username=HIDDEN_NAME, hidden=True),
                         plan_row(demo, 9.0, PLANNED_AT - timedelta(minutes=5)), plan_row(demo, 1.25, PLANNED_AT)])
        session.commit()
    return create_app(Settings(database_url=database_url, data_dir=tmp_path))


@pytest.fixture
def client(app):
    with TestClient(app) as client:
        yield client


@pytest.fixture
def bearer(sessions):
    with sessions() as session:
        secret = issue_credential(session, user_id=sign_in_locally(session, username="alice").id)
        session.commit()
    return {"authorization": f"Bearer {secret}"}


def test_the_current_plan_is_the_newest_row(sessions):
    with sessions() as session:
        demo = registry.create_run(session, slug="demo", title="Demo")
        quiet = registry.create_run(session, slug="q", title="Q")
        session.add_all([plan_row(demo, 1.25, PLANNED_AT), plan_row(demo, 9.0, PLANNED_AT - timedelta(minutes=5))])
        session.commit()
        assert plans.current_plan(session, demo).predicted_seconds == 1.25
        assert plans.current_plan(session, quiet) is None and plans.public_plan(session, quiet) is None


def test_the_plan_api_gives_roles_shares_and_mbit_per_second(client):
    plan = client.get("/api/v1/runs/demo/plan").json()
    assert [(p["fingerprint"], p["username"], p["role"], p["share"], p["upload_mbps"], p["download_mbps"])
            for p in plan["peers"]] == [
        ("…" + ALICE_PEER[-6:], "alice", "aggregator", 0.625, 100.0, 200.0),
        ("…" + BOB_AUX_PEER[-6:], "bob", "aux", 0.375, 50.0, 50.0),
        ("…" + CAROL_PEER[-6:], plans.HIDDEN_VOLUNTEER, "client", 0.0, 10.0, 20.0),
    ]
    assert (plan["predicted_seconds"], plan["measured_seconds"], plan["lower_bound_seconds"]) == (1.25, 1.5, 0.8)
    assert plan["reason"] == "a peer joined" and plan["vector_bytes"] == 40_000_000
    assert datetime.fromisoformat(plan["created_at"]) == PLANNED_AT
    # Where each trains, as the workers reported it; entries of older plans say nothing.
    assert [p["device"] for p in plan["peers"]] == ["cuda", "", ""]
    # How carol's mode was decided: the portal could not dial her back (the others' entries do not say).
    assert [p["reachability"] for p in plan["peers"]] == ["", "", "unreachable"]


def client_cell(page: str) -> str:
    """The role cell of the plan's only client row."""
    table = page[page.index('id="plan-peers"'):page.index("</table>", page.index('id="plan-peers"'))]
    (row,) = [row for row in table.split("<tr>")[2:] if "client" in row]
    return row.split("<td>")[3].split("</td>")[0]


@pytest.mark.parametrize("reachability, shown", [
    ("unreachable", "client (found unreachable)"),
    ("client", "client (chose client mode)"),
    (None, "client (aggregates nothing)"),  # an entry from before plans said, or a worker that did not
])
def test_the_plan_says_whether_a_client_was_found_unreachable_or_chose_it(sessions, database_url, tmp_path,
                                                                         reachability, shown):
    with sessions() as session:
        demo = registry.create_run(session, slug="demo", title="Demo run")
        row = plan_row(demo, 1.25, PLANNED_AT)
        carol, *others = row.peers
        carol = {key: value for key, value in carol.items() if key != "reachability"}
        row.peers = [carol if reachability is None else {**carol, "reachability": reachability}, *others]
        session.add(row)
        session.commit()
    with TestClient(create_app(Settings(database_url=database_url, data_dir=tmp_path))) as client:
        assert client_cell(client.get("/runs/demo").text) == shown
        peers = client.get("/api/v1/runs/demo/plan").json()["peers"]
    assert [p["reachability"] for p in peers if p["role"] == "client"] == [reachability or ""]


def test_a_plan_naming_peer_keys_labels_each_peer_as_its_owners_page_does(sessions, database_url, tmp_path):
    # Entries the coordinator writes now carry the peer key: the plan shows its fingerprint, never the key or the
    # PeerID, and an entry of an older plan without one still reads (by its PeerID's tail).
    alice_key, bob_key = ALICE_KEY, "ef56ab78" + "9" * 56  # alice's as on her page (test_contribution_pages)
    with sessions() as session:
        demo = registry.create_run(session, slug="demo", title="Demo run")
        row = plan_row(demo, 1.25, PLANNED_AT)
        row.peers = [{**peer, "peer_key": key} for peer, key in zip(row.peers, ["", alice_key, bob_key])]
        session.add(row)
        session.commit()
    with TestClient(create_app(Settings(database_url=database_url, data_dir=tmp_path))) as client:
        answer = client.get("/api/v1/runs/demo/plan")
        page = client.get("/runs/demo").text
    assert [p["fingerprint"] for p in answer.json()["peers"]] == [
        fingerprint(alice_key), fingerprint(bob_key), "…" + CAROL_PEER[-6:]]
    assert fingerprint(alice_key) == "ab12cd34" and f"<code>{fingerprint(alice_key)}</code>" in page
    for secret in (alice_key, bob_key, ALICE_PEER, BOB_AUX_PEER, alice_key[:9]):
        assert secret not in answer.text and secret not in page


def test_the_plan_shows_no_full_peer_id_and_no_hidden_name(client):
    for answer in (client.get("/api/v1/runs/demo/plan"), client.get("/runs/demo")):
        assert answer.status_code == 200
        for secret in (ALICE_PEER, BOB_AUX_PEER, CAROL_PEER, HIDDEN_NAME):
            assert secret not in answer.text
        assert plans.HIDDEN_VOLUNTEER in answer.text


def test_no_plan_yet_and_unknown_runs_are_404s_with_a_reason(client):
    quiet = client.get("/api/v1/runs/quiet/plan")
    assert quiet.status_code == 404 and quiet.json() == {"detail": plans.NO_PLAN}
    unknown = client.get("/api/v1/runs/nope/plan")
    assert unknown.status_code == 404 and unknown.json() == {"detail": "no run named 'nope'"}


def test_the_dashboard_shows_the_plan_and_its_round_times(client):
    page = client.get("/runs/demo").text
    assert '<div id="plan">' in page and 'id="no-plan" hidden' in page
    table = page[page.index('id="plan-peers"'):page.index("</table>", page.index('id="plan-peers"'))]
    rows = table.split("<tr>")[2:]  # after the header row
    assert ["62.5 %" in rows[0], "alice" in rows[0], "100.0" in rows[0], "200.0" in rows[0]] == [True] * 4
    assert "auxiliary" in rows[1] and "37.5 %" in rows[1] and "client" in rows[2] and "10.0" in rows[2]
    assert 'id="plan-predicted">1.25 s<' in page and 'id="plan-measured">1.50 s<' in page
    assert 'id="plan-lower-bound">800 ms<' in page  # below a second: milliseconds


def test_the_dashboard_says_when_there_is_no_plan(client):
    page = client.get("/runs/quiet").text
    assert '<p class="empty" id="no-plan">No averaging plan yet' in page and '<div id="plan" hidden>' in page


@pytest.mark.parametrize("size", [1, 100_000, LINK_PROBE_MAX_BYTES])
def test_the_download_probe_sends_exactly_size_random_bytes(client, bearer, size):
    answer = client.get("/api/v1/runs/demo/link-probe", params={"size": size}, headers=bearer)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/octet-stream"
    assert len(answer.content) == size
    if size > 1000:  # random: no compression on the way could make the link look faster
        assert len(zlib.compress(answer.content)) > 0.99 * size


@pytest.mark.parametrize("size", [0, 12_345, LINK_PROBE_MAX_BYTES])
def test_the_upload_probe_counts_the_body(client, bearer, size):
    answer = client.post("/api/v1/runs/demo/link-probe", content=b"\x5a" * size, headers=bearer)
    assert answer.status_code == 200 and answer.json() == {"bytes": size}


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer dedloc_not-a-credential"}])
def test_probes_need_an_api_credential(client, method, headers):
    answer = client.request(method, "/api/v1/runs/demo/link-probe?size=10", content=b"abc", headers=headers)
    assert answer.status_code == 401 and "credential" in answer.json()["detail"]


@pytest.mark.parametrize("query", ["size=0", f"size={LINK_PROBE_MAX_BYTES + 1}", "size=-5", "size=lots", ""])
def test_a_probe_size_out_of_range_is_a_422_with_a_reason(client, bearer, query):
    answer = client.get(f"/api/v1/runs/demo/link-probe?{query}", headers=bearer)
    assert answer.status_code == 422 and answer.json()["detail"].startswith("query.size: ")


def test_an_oversize_upload_is_a_413_with_a_reason(client, bearer):
    declared = client.post("/api/v1/runs/demo/link-probe", content=bytes(LINK_PROBE_MAX_BYTES + 1), headers=bearer)
    assert declared.status_code == 413 and str(LINK_PROBE_MAX_BYTES) in declared.json()["detail"]
    chunks = (bytes(1 << 20) for _ in range(LINK_PROBE_MAX_BYTES // (1 << 20) + 1))  # chunked: no Content-Length
    streamed = client.post("/api/v1/runs/demo/link-probe", content=chunks, headers=bearer)
    assert streamed.status_code == 413 and str(LINK_PROBE_MAX_BYTES) in streamed.json()["detail"]


def test_an_endless_upload_is_cut_off_just_past_the_limit():
    chunk, sent = 1 << 16, []

    async def receive():
        sent.append(chunk)
        return {"type": "http.request", "body": bytes(chunk), "more_body": True}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(TooLarge):
        asyncio.run(count_body(request, 10 * chunk))
    assert sum(sent) == 11 * chunk


def test_an_upload_declared_oversize_is_refused_before_reading_it():
    sent = []

    async def receive():
        sent.append(1)
        return {"type": "http.request", "body": b"x", "more_body": False}

    headers = [(b"content-length", str(LINK_PROBE_MAX_BYTES + 1).encode())]
    request = Request({"type": "http", "method": "POST", "headers": headers}, receive)
    with pytest.raises(TooLarge, match="at most"):
        asyncio.run(count_body(request, LINK_PROBE_MAX_BYTES))
    assert sent == []


def test_probes_of_an_unknown_run_are_404s(client, bearer):
    assert client.get("/api/v1/runs/nope/link-probe?size=10", headers=bearer).status_code == 404
    assert client.post("/api/v1/runs/nope/link-probe", content=b"abc", headers=bearer).status_code == 404
