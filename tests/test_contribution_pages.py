"""The read side of accounting on a real database (SQLite and PostgreSQL) and the real app: boards by user and by
team, a user's public totals, the "My contribution" page and its settings, organizers releasing held credit,
and the credited and held series of /metrics. Hidden users appear in no public page or answer."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.core.config import Settings
from app.credit.ledger import leaderboard
from app.credit.review import REASON_LENGTH, released_reason
from app.credit.standings import team_leaderboard
from app.identity.models import User
from app.runs import registry
from app.web.main import create_app
from tests.support.factories import ALICE_KEY, ALONE, HIDDEN_NAME, START, TOO_FAST, populate
from tests.support.portal import form_token


def sign_in(client: TestClient, username: str) -> TestClient:
    page = client.get("/signin")
    signed = client.post("/signin/dev", data={"username": username, "csrf": form_token(page.text)},
                         follow_redirects=False)
    assert signed.status_code == 303, signed.text
    return client


@pytest.fixture
def app(database_url, sessions, tmp_path):
    with sessions() as session:
        populate(session)
    return create_app(Settings(database_url=database_url, data_dir=tmp_path, organizers=["olivia"]))


@pytest.fixture
def client(app):
    """An anonymous visitor (the development sign-in is offered: the settings bind to loopback)."""
    with TestClient(app) as client:
        yield client


def browser(app) -> TestClient:
    """Another visitor with cookies of their own."""
    return TestClient(app)


def rows(board, *fields):
    return [tuple(getattr(row, f) for f in fields) for row in board]


def test_boards_sum_credited_and_held_by_user_and_by_team(sessions):
    with sessions() as session:
        populate(session)
        demo, second = registry.get_run(session, "demo"), registry.get_run(session, "second")
        fields = ("username", "samples", "held_samples", "team", "peers")
        assert rows(leaderboard(session, demo), *fields) == [
            ("bob", 700, 0, "hf-org", 1), ("alice", 600, 400, "hf-org", 1), ("ghost", 50, 0, None, 1)]
        assert rows(leaderboard(session, None), *fields) == [
            ("alice", 1600, 400, "hf-org", 2), ("bob", 700, 0, "hf-org", 1), ("dave", 200, 20, None, 1),
            ("ghost", 50, 0, None, 1)]
        alice = leaderboard(session, demo)[1]
        # epoch 3, credited nothing, adds no runtime
        assert alice.runtime_seconds == 6.0 and alice.last_seen == START + timedelta(minutes=3)

        team = lambda board: [(r.team, r.members, r.samples, r.held_samples) for r in board]
        assert team(team_leaderboard(session, demo)) == [("hf-org", 2, 1300, 400)]  # carol hides: not summed
        assert team(team_leaderboard(session, second)) == [("hf-org", 1, 1000, 0)]
        assert team(team_leaderboard(session, None)) == [("hf-org", 2, 2300, 400)]


def test_the_leaderboard_api_keeps_its_contract_and_gains_held_and_team(client):
    board = client.get("/api/v1/runs/demo/leaderboard").json()
    assert [(r["username"], r["samples"], r["held_samples"], r["team"]) for r in board] == [
        ("bob", 700, 0, "hf-org"), ("alice", 600, 400, "hf-org"), ("ghost", 50, 0, None)]
    assert board[1]["runtime_seconds"] == 6.0 and board[1]["peers"] == 1
    assert datetime.fromisoformat(board[1]["last_seen"]) == START + timedelta(minutes=3)
    assert [r["username"] for r in client.get("/api/v1/runs/demo/leaderboard?limit=1").json()] == ["bob"]

    overall = client.get("/api/v1/leaderboard").json()
    assert [(r["username"], r["samples"], r["held_samples"]) for r in overall] == [
        ("alice", 1600, 400), ("bob", 700, 0), ("dave", 200, 20), ("ghost", 50, 0)]
    [team] = client.get("/api/v1/teams").json()
    assert (team["team"], team["members"], team["samples"], team["held_samples"], team["peers"]) == (
        "hf-org", 2, 2300, 400, 3)
    [team] = client.get("/api/v1/runs/second/teams").json()
    assert (team["team"], team["samples"]) == ("hf-org", 1000)
    assert client.get("/api/v1/runs/nope/teams").status_code == 404
    assert client.get("/api/v1/teams?limit=0").status_code == 422


def test_a_users_public_totals_and_404s(client):
    alice = client.get("/api/v1/users/alice").json()
    assert (alice["samples"], alice["held_samples"], alice["runtime_seconds"], alice["peers"], alice["team"]) == (
        1600, 400, 8.0, 2, "hf-org")
    assert [(r["run"], r["samples"], r["held_samples"], r["peers"]) for r in alice["runs"]] == [
        ("demo", 600, 400, 1), ("second", 1000, 0, 1)]
    ghost = client.get("/api/v1/users/ghost").json()  # credited, but never signed in here: no user row
    assert (ghost["samples"], ghost["team"], [r["run"] for r in ghost["runs"]]) == (50, None, ["demo"])
    olivia = client.get("/api/v1/users/olivia").json()  # signed in, never contributed
    assert (olivia["samples"], olivia["last_seen"], olivia["runs"]) == (0, None, [])

    hidden, unknown = client.get(f"/api/v1/users/{HIDDEN_NAME}"), client.get("/api/v1/users/nobody")
    assert hidden.status_code == unknown.status_code == 404
    assert hidden.json() == unknown.json()  # a 404 does not tell that a hidden user exists
    assert "unknown, or hidden" in hidden.json()["detail"]
    assert client.get("/api/v1/users/" + "x" * 200).status_code == 422


PUBLIC_PAGES = ["/", "/runs/demo", "/runs/demo/leaderboard", "/runs/second/leaderboard", "/leaderboard",
                "/api/v1/runs/demo/leaderboard", "/api/v1/runs/demo/teams", "/api/v1/leaderboard", "/api/v1/teams",
                f"/api/v1/users/{HIDDEN_NAME}", "/api/v1/runs/demo/swarm", "/metrics"]


def test_a_hidden_user_is_on_no_public_page_or_answer_and_still_sees_their_own_page(client, app):
    for path in PUBLIC_PAGES:
        response = client.get(path)
        assert response.status_code in (200, 404), (path, response.status_code)
        assert HIDDEN_NAME not in response.text, path
    assert "bob" in client.get("/runs/demo/leaderboard").text  # the pages do name the others

    own = sign_in(browser(app), HIDDEN_NAME).get("/me")
    assert own.status_code == 200
    assert 'id="hidden-note"' in own.text and "5,000" in own.text and "secret box" in own.text


def test_my_page_shows_my_peers_credit_per_epoch_and_why_samples_are_held(client, app):
    away = client.get("/me", follow_redirects=False)
    assert away.status_code == 303 and away.headers["location"] == "/signin?next=%2Fme"

    page = sign_in(browser(app), "alice").get("/me").text
    peers = page[page.index('id="peers"'):page.index("</table>", page.index('id="peers"'))]
    assert "ab12cd34" in peers and "ef56ab78" in peers and "NVIDIA GeForce RTX 3090 (24 GiB)" in peers
    assert ALICE_KEY not in page and ALICE_KEY[:9] not in page  # a short fingerprint, never the key
    held = page[page.index('id="held"'):page.index("</table>", page.index('id="held"'))]
    assert TOO_FAST in held and ALONE in held and held.count("<tr>") == 3  # heading and two held epochs
    epochs = page[page.index('id="epochs"'):page.index("</table>", page.index('id="epochs"'))]
    assert epochs.count("<tr>") == 6  # heading, four demo epochs, one of the second run
    assert "1,600" in page and "bob" not in page  # her totals, nobody else's


def test_my_settings_hide_me_and_choose_my_team(client, app, sessions):
    alice = sign_in(browser(app), "alice")
    token = form_token(alice.get("/me").text)
    saved = alice.post("/me/settings", data={"csrf": token, "hidden": "true", "team": "other-org"},
                       follow_redirects=False)
    assert saved.status_code == 303 and saved.headers["location"] == "/me"
    assert [r["username"] for r in client.get("/api/v1/leaderboard").json()] == ["bob", "dave", "ghost"]
    assert client.get("/api/v1/users/alice").status_code == 404
    assert "alice" not in client.get("/leaderboard").text
    assert [t["team"] for t in client.get("/api/v1/teams").json()] == ["hf-org"]  # hidden: in no team's sum

    refused = alice.post("/me/settings", data={"csrf": token, "team": "not-my-org"})
    assert refused.status_code == 422 and "not-my-org" in refused.json()["detail"]
    assert alice.post("/me/settings", data={"csrf": "forged", "team": ""}).status_code == 403
    with sessions() as session:
        user = session.scalar(select(User).where(User.username == "alice"))
        assert (user.hidden, user.team) == (True, "other-org")

    alice.post("/me/settings", data={"csrf": token, "team": "other-org"})  # unchecked box: shown again
    assert [(t["team"], t["samples"]) for t in client.get("/api/v1/teams").json()] == [
        ("other-org", 1600), ("hf-org", 700)]
    assert 'value="other-org" selected' in alice.get("/me").text


def test_an_organizer_releases_held_credit(client, app):
    alice = sign_in(browser(app), "alice")
    assert alice.post("/runs/demo/organize/release", data={
        "csrf": form_token(alice.get("/me").text), "username": "alice"}).status_code == 403

    olivia = sign_in(browser(app), "olivia")
    page = olivia.get("/runs/demo/organize").text
    held = page[page.index('id="held"'):page.index("</table>", page.index('id="held"'))]
    assert "alice" in held and "2, 3" in held and TOO_FAST in held and ALONE in held
    release = lambda **data: olivia.post("/runs/demo/organize/release", data={"csrf": form_token(page), **data},
                                         follow_redirects=False)
    assert release(username="alice", epoch="2").status_code == 303
    alice_row = lambda: next(r for r in client.get("/api/v1/runs/demo/leaderboard").json() if r["username"] == "alice")
    assert (alice_row()["samples"], alice_row()["held_samples"]) == (900, 100)
    mine = alice.get("/me").text
    assert f"{TOO_FAST} (released by olivia)" in mine
    held = mine[mine.index('id="held"'):mine.index("</table>", mine.index('id="held"'))]
    assert ALONE in held and TOO_FAST not in held  # released epochs leave the held list

    assert release(username="alice", epoch="").status_code == 303  # every epoch still held
    assert (alice_row()["samples"], alice_row()["held_samples"]) == (1000, 0)
    again = release(username="alice")
    assert again.status_code == 404 and "no held credit" in again.json()["detail"]
    assert "nothing held" in olivia.get("/runs/demo/organize").text


def test_a_released_reason_fits_its_column():
    reason = released_reason("x" * 400, "olivia")
    assert len(reason) == REASON_LENGTH and reason.endswith(" (released by olivia)")
    assert released_reason(None, "olivia") == "held (released by olivia)"


def test_metrics_have_credited_and_held_samples_per_run(client):
    text = client.get("/metrics").text
    assert 'dedloc_samples_credited{run="demo"} 6350.0' in text  # a run's total counts hidden users too
    assert 'dedloc_samples_held{run="demo"} 400.0' in text
    assert 'dedloc_samples_credited{run="second"} 1200.0' in text and 'dedloc_samples_held{run="second"} 20.0' in text
    assert "# TYPE dedloc_samples_held gauge" in text
