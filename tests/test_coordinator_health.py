"""`dedloc coordinator-health --run SLUG`, the coordinator container's health check, on a migrated SQLite database:
exit 0 while the run's coordinator heartbeat is younger than the coordinator timeout, else 1 and one line saying
what is wrong."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta

import pytest

from app.cli.main import main
from app.core.clock import utcnow
from app.core.database import make_engine, make_sessionmaker, migrate
from app.models import Coordinator
from app.runs import registry

TIMEOUT = 30.0


@pytest.fixture
def database(tmp_path, monkeypatch) -> str:
    url = f"sqlite:///{tmp_path / 'dedloc.sqlite3'}"
    migrate(url)
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("DEDLOC_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("DEDLOC_COORDINATOR_TIMEOUT", str(TIMEOUT))
    return url


@pytest.fixture
def sessions(database):
    engine = make_engine(database)
    with make_sessionmaker(engine)() as session:
        registry.create_run(session, slug="demo", title="Demo")
    yield make_sessionmaker(engine)
    engine.dispose()


def check(capsys, slug: str = "demo") -> tuple[int, list[str]]:
    code = main(["coordinator-health", "--run", slug])
    return code, capsys.readouterr().err.splitlines()


def beat(sessions, seconds_ago: float, peer_id: str = "QmCoordinator") -> None:
    with sessions() as session:
        row = registry.register_coordinator(session, registry.get_run(session, "demo"), peer_id, ["/ip4/1.2.3.4/tcp/1"])
        row = session.get(Coordinator, row.id)
        row.heartbeat_at = utcnow() - timedelta(seconds=seconds_ago)
        session.commit()


def test_a_fresh_heartbeat_is_healthy(sessions, capsys):
    beat(sessions, seconds_ago=1)
    assert check(capsys) == (0, [])


def test_no_coordinator_yet_is_unhealthy(sessions, capsys):
    code, err = check(capsys)
    assert code == 1 and len(err) == 1
    assert "no coordinator of run 'demo' has started yet" in err[0]


def test_a_stale_heartbeat_is_unhealthy_and_says_how_old(sessions, capsys):
    beat(sessions, seconds_ago=TIMEOUT + 15)
    code, err = check(capsys)
    assert code == 1 and len(err) == 1
    found = re.search(r"run 'demo': its newest coordinator heartbeat is (\d+) s old, past the coordinator timeout "
                      r"\(30 s", err[0])
    assert found, err[0]
    assert TIMEOUT + 15 <= int(found.group(1)) <= TIMEOUT + 25  # and the seconds this test took to get there


def test_the_timeout_is_the_setting(sessions, capsys, monkeypatch):
    beat(sessions, seconds_ago=TIMEOUT + 15)
    monkeypatch.setenv("DEDLOC_COORDINATOR_TIMEOUT", str(TIMEOUT * 2))
    assert check(capsys) == (0, [])


def test_a_stopped_coordinator_is_unhealthy_though_its_heartbeat_is_fresh(sessions, capsys):
    beat(sessions, seconds_ago=1)
    with sessions() as session:
        registry.heartbeat(session, session.query(Coordinator).one().id, alive=False)
    code, err = check(capsys)
    assert code == 1 and len(err) == 1 and "the coordinator of run 'demo' stopped at" in err[0]


def test_one_fresh_coordinator_of_several_is_enough(sessions, capsys):
    beat(sessions, seconds_ago=TIMEOUT + 100, peer_id="QmOld")
    beat(sessions, seconds_ago=2, peer_id="QmNew")
    assert check(capsys) == (0, [])


def test_an_unknown_run_or_an_unmigrated_database_is_unhealthy_not_exit_2(database, capsys, tmp_path, monkeypatch):
    code, err = check(capsys, "nope")
    assert code == 1 and len(err) == 1 and "cannot read run 'nope'" in err[0]
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'empty.sqlite3'}")
    code, err = check(capsys)
    assert code == 1 and len(err) == 1 and "cannot read run 'demo'" in err[0]


def test_the_command_exits_1_with_one_line(sessions):
    beat(sessions, seconds_ago=TIMEOUT + 15)
    done = subprocess.run([sys.executable, "-m", "app.cli", "coordinator-health", "--run", "demo"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 1, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "past the coordinator timeout" in done.stderr
    assert "Traceback" not in done.stderr
