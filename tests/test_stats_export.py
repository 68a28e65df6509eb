"""The daily stats dumps (users and teams, gzip JSON and CSV) on SQLite and PostgreSQL: what they hold, that
hidden users are not in them, when they are due, the `dedloc export-stats` command, and their stable URLs."""

from __future__ import annotations

import csv
import gzip
import io
import json
from datetime import datetime, timedelta, timezone

import pytest
from fastapi.testclient import TestClient

from app.cli.main import main
from app.core.config import Settings
from app.credit.stats_export import FILES, export_if_due, export_stats, stats_dir
from app.web.main import create_app
from tests.support.factories import HIDDEN_NAME, START, populate


def read(path) -> str:
    return gzip.decompress(path.read_bytes()).decode()


def csv_rows(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


@pytest.fixture
def populated(sessions):
    with sessions() as session:
        populate(session)
    return sessions


def test_the_dumps_parse_hold_every_public_total_and_leave_hidden_users_out(populated, tmp_path):
    now = datetime(2025, 3, 2, tzinfo=timezone.utc)
    with populated() as session:
        written = export_stats(session, tmp_path / "stats", now)
    assert [path.name for path in written] == list(FILES)
    for path in written:
        assert HIDDEN_NAME not in read(path), path.name

    users = json.loads(read(tmp_path / "stats" / "users.json.gz"))
    assert users["generated_at"] == now.isoformat()
    assert [(u["username"], u["team"], u["samples"], u["held_samples"]) for u in users["users"]] == [
        ("alice", "hf-org", 1600, 400), ("bob", "hf-org", 700, 0), ("dave", None, 200, 20), ("ghost", None, 50, 0)]
    alice = users["users"][0]
    assert [(r["run"], r["samples"], r["held_samples"], r["runtime_seconds"]) for r in alice["runs"]] == [
        ("demo", 600, 400, 6.0), ("second", 1000, 0, 2.0)]  # runtime of credited epochs only
    assert datetime.fromisoformat(alice["last_seen"]) == START + timedelta(minutes=3)

    rows = csv_rows(read(tmp_path / "stats" / "users.csv.gz"))
    assert list(rows[0]) == ["username", "team", "run", "samples", "held_samples", "runtime_seconds", "peers",
                             "last_seen"]
    assert [(r["username"], r["run"], r["samples"], r["held_samples"]) for r in rows[:3]] == [
        ("alice", "", "1600", "400"), ("alice", "demo", "600", "400"), ("alice", "second", "1000", "0")]
    assert [(r["username"], r["team"]) for r in rows if r["run"] == ""] == [
        ("alice", "hf-org"), ("bob", "hf-org"), ("dave", ""), ("ghost", "")]

    [team] = json.loads(read(tmp_path / "stats" / "teams.json.gz"))["teams"]
    assert (team["team"], team["members"], team["samples"], team["held_samples"]) == ("hf-org", 2, 2300, 400)
    assert [(r["run"], r["members"], r["samples"]) for r in team["runs"]] == [("demo", 2, 1300), ("second", 1, 1000)]
    teams = csv_rows(read(tmp_path / "stats" / "teams.csv.gz"))
    assert [(r["team"], r["run"], r["members"], r["samples"]) for r in teams] == [
        ("hf-org", "", "2", "2300"), ("hf-org", "demo", "2", "1300"), ("hf-org", "second", "1", "1000")]


def test_the_export_is_due_once_a_day(populated, tmp_path):
    generated = lambda: json.loads(read(stats_dir(tmp_path) / "users.json.gz"))["generated_at"]
    now = datetime.now(timezone.utc)
    assert export_if_due(populated, tmp_path, now) is True
    assert generated() == now.isoformat()
    assert export_if_due(populated, tmp_path, now + timedelta(hours=23)) is False
    assert generated() == now.isoformat()
    later = now + timedelta(hours=24, minutes=1)
    assert export_if_due(populated, tmp_path, later) is True
    assert generated() == later.isoformat()

    (stats_dir(tmp_path) / "teams.csv.gz").unlink()  # an incomplete export is due at once
    assert export_if_due(populated, tmp_path, later) is True
    assert (stats_dir(tmp_path) / "teams.csv.gz").is_file()


def test_the_command_writes_the_dumps_the_portal_serves(populated, database_url, tmp_path, monkeypatch, capsys):
    with TestClient(create_app(Settings(database_url=database_url, data_dir=tmp_path))) as client:
        before = client.get("/stats/users.json.gz")
        assert before.status_code == 404 and "dedloc export-stats" in before.json()["detail"]
        unknown = client.get("/stats/passwords.txt")
        assert unknown.status_code == 404 and "users.json.gz" in unknown.json()["detail"]

        monkeypatch.setenv("DATABASE_URL", database_url)
        monkeypatch.setenv("DEDLOC_DATA_DIR", str(tmp_path))
        assert main(["export-stats"]) == 0
        assert "wrote users.json.gz, users.csv.gz, teams.json.gz, teams.csv.gz" in capsys.readouterr().out

        served = client.get("/stats/users.json.gz")
        assert served.status_code == 200 and served.headers["content-type"] == "application/gzip"
        assert [u["username"] for u in json.loads(gzip.decompress(served.content))["users"]] == [
            "alice", "bob", "dave", "ghost"]
        teams = client.get("/stats/teams.csv.gz")
        assert csv_rows(gzip.decompress(teams.content).decode())[0]["team"] == "hf-org"
        assert "/stats/users.csv.gz" in client.get("/leaderboard").text


def test_the_command_writes_where_it_is_told(populated, database_url, tmp_path, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", database_url)
    assert main(["export-stats", "--out", str(tmp_path / "elsewhere")]) == 0
    assert sorted(path.name for path in (tmp_path / "elsewhere").iterdir()) == sorted(FILES)
