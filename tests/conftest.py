"""Fixtures shared by the test suite: an output folder, databases (SQLite and a throwaway PostgreSQL), and a
real loopback deployment."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from app.core.database import make_engine, make_sessionmaker, migrate
from tests.harness import Deployment, free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def output_dir() -> Path:
    """Where tests leave what a person may want to look at: screenshots, process logs."""
    path = Path(os.environ.get("DEDLOC_TEST_OUTPUT", ROOT / "test-output"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def deployment(tmp_path, output_dir, request):
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)
    logs = output_dir / "logs" / name
    shutil.rmtree(logs, ignore_errors=True)
    deployed = Deployment(tmp_path, logs)
    yield deployed
    deployed.close()


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


@pytest.fixture(scope="session")
def postgres_url():
    """A throwaway PostgreSQL cluster for this test run (skipped where the server binaries are missing)."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL server binaries are not installed (apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="dedloc-pg-"))
    data, port = root / "data", free_port()
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    shutil.chown(root, "postgres") if os.geteuid() == 0 else None
    run = lambda *args: subprocess.run([*as_postgres, *args], check=True, capture_output=True, timeout=120)
    run(str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust")
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """An empty database URL on each engine the project supports."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'dedloc.sqlite3'}"
    base = request.getfixturevalue("postgres_url")
    name = f"t_{os.urandom(4).hex()}"
    engine = make_engine(base)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.exec_driver_sql(f"CREATE DATABASE {name}")
    engine.dispose()
    return base.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture
def sessions(database_url):
    """A session factory on a migrated database (both engines)."""
    migrate(database_url)
    engine = make_engine(database_url)
    yield make_sessionmaker(engine)
    engine.dispose()
