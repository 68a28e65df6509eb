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

from app.db import make_engine, make_sessionmaker, migrate
from tests.harness import Deployment, free_port

ROOT = Path(__file__).resolve().parent.parent
# hivemind peers though not a whole swarm, or processes that import torch: they take a core each while they run
HEAVY_MODULES = {"test_averaging_plan", "test_bench_emulation", "test_cli"}
HEAVY_TESTS = ("never_imports",)  # test_api's import checks start fresh interpreters


def pytest_collection_modifyitems(items):
    """Tests that run hivemind peers or start heavy processes go one after another on one xdist worker (they need
    the CPU more than company: round formation and the liars' ceiling depend on it); the rest, the portal's and the
    database's tests in-process, run beside them on the other worker (`-n 2 --dist loadgroup` in pyproject.toml).
    """
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if item.get_closest_marker("swarm") or module in HEAVY_MODULES or any(t in item.name for t in HEAVY_TESTS):
            item.add_marker(pytest.mark.xdist_group("hivemind"))


@pytest.fixture(autouse=True)
def _yield_the_cpu_to_hivemind(request):
    """The other tests run at a low priority beside the hivemind ones, and so does whatever they start.

    Measured on 2 cores: side by side at equal priority the swarm tests slowed from 44-79 s to 108-133 s each, and
    a process's own nice value did not help: with the kernel's autogroups (``sched_autogroup_enabled``) CPU is
    shared between sessions first, and the swarm's processes each run in a session of their own. So this lowers
    the priority of this test's whole session (``/proc/self/autogroup``, which needs root; elsewhere the tests run
    as they are), and of the process itself for what it starts in its own session.
    """
    autogroup = Path("/proc/self/autogroup")
    if request.node.get_closest_marker("xdist_group") is not None or os.geteuid() != 0 or not autogroup.exists():
        yield
        return
    before = os.getpriority(os.PRIO_PROCESS, 0), re.search(r"nice (-?\d+)", autogroup.read_text()).group(1)
    os.setpriority(os.PRIO_PROCESS, 0, 15)
    autogroup.write_text("15")
    try:
        yield
    finally:
        autogroup.write_text(before[1])
        os.setpriority(os.PRIO_PROCESS, 0, before[0])


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
