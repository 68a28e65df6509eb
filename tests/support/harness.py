"""A real deployment on loopback for tests: portal, coordinator and workers as separate processes.

Every process gets its own process group and an environment tag; ``close`` ends them all and then kills anything
still carrying the tag, so hivemind's DHT, averager and p2pd children never outlive a test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

import httpx
from dedloc_worker.session import CREDENTIAL_ENV
from sqlalchemy import func, select

from app.core.database import make_engine, make_sessionmaker, one_session
from app.core.processes import kill_group, spawn, stop
from app.core.processes import tagged_processes as processes_tagged
from app.models import Contribution

TAG = "DEDLOC_TEST_TAG"
ROOT = Path(__file__).resolve().parents[2]  # the repository


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tagged_processes(tag: str) -> list[int]:
    """Live processes whose environment carries ``DEDLOC_TEST_TAG=tag``."""
    return processes_tagged(TAG, tag)


def hivemind_sockets() -> set[str]:
    """hivemind's Unix socket files in /tmp: p2pd's and its clients'."""
    return {str(path) for path in Path("/tmp").glob("hivemind-*.sock")}


def unbound_hivemind_sockets() -> set[str]:
    """``hivemind_sockets`` that no live socket of this network namespace is bound to: what processes that ended left
    behind. Live ones are in /proc/net/unix."""
    bound = {line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:] if len(line.split()) > 7}
    return hivemind_sockets() - bound


def local_epoch(text: str) -> int:
    """The epoch a worker is at, by the last progress line of its log (printed as its epoch changes); -1 before."""
    found = re.findall(r"^epoch (\d+) \|", text, re.MULTILINE)
    return int(found[-1]) if found else -1


def wait_for(check: Callable[[], object], timeout: float, what: str | Callable[[], str], interval: float = 0.25):
    """Poll ``check`` until it returns something truthy; fail the test with ``what`` after ``timeout`` s (a callable
    ``what`` says how things stood then)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}")
        time.sleep(interval)


class Deployment:
    """Portal + coordinator + workers of one run, in ``workdir``; logs under ``logs``."""

    def __init__(self, workdir: Path, logs: Path, slug: str = "test"):
        self.workdir, self.logs, self.slug = workdir, logs, slug
        logs.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tag = uuid.uuid4().hex
        # Every process's temporary files (keys, tokens, p2pd sockets) in one folder that close() removes, also
        # those of a process it had to kill. Short, under /tmp: a unix socket's path must fit 108 bytes.
        self.tmp = Path(tempfile.mkdtemp(prefix="dedloc-test-"))
        self.env = {
            "TMPDIR": str(self.tmp),
            "DEDLOC_DATA_DIR": str(workdir / "var"),
            "DEDLOC_PORT": str(self.port),
            "DEDLOC_POLL_INTERVAL": "1",
            "DEDLOC_LIVE_INTERVAL": "0.5",
            "DATABASE_URL": "",
            TAG: self.tag,
        }
        self.database_url = f"sqlite:///{workdir / 'var' / 'dedloc.sqlite3'}"
        self.processes: dict[str, subprocess.Popen] = {}

    # processes -------------------------------------------------------------------------------------------
    def start(self, name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        proc = spawn([sys.executable, *args], log=self.logs / f"{name}.log", env={**self.env, **(env or {})},
                     cwd=self.workdir)
        self.processes[name] = proc
        return proc

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "app.cli", *args], env={**os.environ, **self.env},
                              cwd=self.workdir, capture_output=True, text=True, timeout=120)

    def create_run(self, target_batch_size: int = 2048, batch_size: int = 16, checkpoints: dict | None = None,
                   **optimizer) -> None:
        # next_chunk_timeout: three to five workers, their DHTs and averagers and the portal share two cores here,
        # and an averager process starved for over a second dropped a sender from the round (a partial round)
        options = {"matchmaking_time": 1.0, "averaging_timeout": 10.0, "metadata_expiration": 10.0,
                   "next_chunk_timeout": 3.0, **optimizer}
        # No checkpoints and no spot checks: a state download every few epochs is cores these tests need for their
        # rounds (tests/test_real_models.py checks checkpoints, tests/test_spot_checks.py spot checks, on their own).
        checkpoints = {"every_epochs": 10**6, "spot_check_rate": 0.0, **(checkpoints or {})}
        # What `dedloc create-run` does (migrate, then the registry's checks), in this process: a CLI process cost
        # seconds of start-up (tests/test_cli.py runs the command).
        from app.runs import registry

        (self.workdir / "var").mkdir(parents=True, exist_ok=True)
        with one_session(self.database_url) as session:
            registry.create_run(session, slug=self.slug, title=self.slug, target_batch_size=target_batch_size,
                                batch_size=batch_size, optimizer=options, checkpoints=checkpoints)

    def start_portal(self, wait: bool = True) -> None:
        self.start("portal", "-m", "app.cli", "serve")
        if wait:
            self.wait_for_portal()

    def wait_for_portal(self) -> None:
        wait_for(lambda: httpx.get(f"{self.url}/healthz").status_code == 200, 60, "the portal")

    def start_servers(self) -> list[str]:
        """The portal and the run's coordinator, started together (neither waits for the other; the coordinator
        works from the database); returns the coordinator's addresses once the portal offers them."""
        self.start_portal(wait=False)
        self.start_coordinator()
        self.wait_for_portal()
        return self.wait_for_coordinator()

    def start_coordinator(self, name: str = "coordinator") -> subprocess.Popen:
        proc = self.start(name, "-m", "app.cli", "coordinator", "--run", self.slug)
        return proc

    def wait_for_coordinator(self) -> list[str]:
        return wait_for(lambda: self.get(f"/api/v1/runs/{self.slug}/join")["initial_peers"], 90, "a coordinator")

    def credential(self, username: str) -> str:
        """A worker API credential for ``username``, as ``dedloc issue-credential`` issues one, in this process: a
        CLI process per worker cost seconds."""
        from app.identity.accounts import issue_headless_credential

        with one_session(self.database_url, migrate_first=False) as session:
            return issue_headless_credential(session, username)

    def start_worker(self, username: str, *extra: str, script: list[str] = ("-m", "dedloc_worker")):
        """Start ``dedloc-worker join`` for ``username`` (``script`` replaces ``-m dedloc_worker``)."""
        proc = spawn(
            [sys.executable, *script, "join", self.url, "--run", self.slug,
             "--listen", "/ip4/127.0.0.1/tcp/0", "--report", str(self.report_path(username)),
             "--state-out", str(self.workdir / f"{username}.pt"), "--threads", "1", *extra],
            log=self.logs / f"{username}.log", env={**self.env, CREDENTIAL_ENV: self.credential(username)},
            cwd=self.workdir,
        )
        self.processes[username] = proc
        return proc

    def start_swarm(self, workers: list[str], *worker_args: str) -> None:
        """A fresh run; the first worker founds it, the others join once it trains (``wait_for_founder``)."""
        self.create_run(target_batch_size=2048)
        self.start_servers()
        first, *others = workers
        self.start_worker(first, *worker_args)
        self.wait_for_founder(first)
        for name in others:
            self.start_worker(name, *worker_args)

    def wait_for_founder(self, name: str, timeout: float = 90) -> None:
        """Until the run's first worker trains, seen by the coordinator: a worker started from then on finds its
        progress record, so it trains epoch 0 with it (every peer builds the same initial model from the run's
        seed) or, later, loads its state. Started together, fresh peers can each take epoch 0 alone before they
        find each other, and their parameters part for good (state averaging pulls them close, never equal)."""
        wait_for(lambda: self.swarm()["peers_online"] >= 1, timeout, f"{name} to train")

    def worker_addresses(self) -> list[str]:
        """Multiaddrs (with /p2p/ID) of workers the coordinator saw lately."""
        from app.models import Coordinator

        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                return [addr for row in session.scalars(select(Coordinator)) for addr in row.known_peers]
        finally:
            engine.dispose()

    def report_path(self, username: str) -> Path:
        return self.workdir / f"{username}.json"

    def report(self, username: str) -> dict:
        return json.loads(self.report_path(username).read_text())

    def wait_exit(self, name: str, timeout: float) -> int:
        return self.processes[name].wait(timeout)

    def stop(self, name: str, sig: int = signal.SIGTERM, grace: float = 10.0) -> int | None:
        return stop(self.processes[name], grace=grace, sig=sig)

    def kill(self, name: str) -> None:
        """SIGKILL the leader only, as a crash would; its children are left for ``reap`` to find."""
        self.processes[name].send_signal(signal.SIGKILL)
        self.processes[name].wait(10)

    def reap(self, name: str) -> None:
        kill_group(self.processes[name].pid)

    def close(self) -> None:
        """End everything this deployment started: all asked at once, then each process group ended, what is left
        killed after 3 s in all (a test asserts what it needs of a clean exit itself)."""
        procs = list(reversed(self.processes.values()))
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3
        for proc in procs:
            stop(proc, grace=max(deadline - time.monotonic(), 0.1))
        for pid in tagged_processes(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)

    # reading -----------------------------------------------------------------------------------------------
    def get(self, path: str):
        response = httpx.get(f"{self.url}{path}", timeout=10)
        response.raise_for_status()
        return response.json()

    def swarm(self) -> dict:
        return self.get(f"/api/v1/runs/{self.slug}/swarm")

    def credited_by_user(self) -> dict[str, int]:
        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                rows = session.execute(
                    select(Contribution.username, func.sum(Contribution.samples)).group_by(Contribution.username)
                )
                return {username: int(samples) for username, samples in rows}
        finally:
            engine.dispose()

    def credit_by_user(self) -> dict[str, tuple[int, int]]:
        """username -> (credited, held) samples."""
        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                rows = session.execute(select(Contribution.username, func.sum(Contribution.credited),
                                              func.sum(Contribution.held)).group_by(Contribution.username))
                return {username: (int(credited), int(held)) for username, credited, held in rows}
        finally:
            engine.dispose()

    def set_ceiling(self, samples_per_second: float) -> None:
        """What an organizer does: the run's plausible samples/s per peer (``dedloc set-ceiling``)."""
        done = self.cli("set-ceiling", self.slug, str(samples_per_second))
        assert done.returncode == 0, done.stderr

    def set_state(self, state: str) -> None:
        """What an organizer does on the organize page: pause or resume the run (workers follow within seconds)."""
        from app.runs import registry

        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                registry.set_state(session, registry.get_run(session, self.slug), state)
        finally:
            engine.dispose()

    def set_target_epochs(self, target_epochs: int) -> None:
        """What an organizer does on the organize page: move the run's target (workers follow within seconds)."""
        from app.runs import registry

        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                run = registry.get_run(session, self.slug)
                registry.edit_run(session, run, title=run.title, target_epochs=target_epochs, optimizer=run.optimizer,
                                  checkpoints=run.checkpoints)
        finally:
            engine.dispose()

    def held_rows(self) -> list[tuple[str, int, int, str]]:
        """(username, epoch, held samples, reason) of every claim with anything held, by epoch."""
        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                rows = session.execute(select(Contribution.username, Contribution.epoch, Contribution.held,
                                              Contribution.reason).where(Contribution.held > 0)
                                       .order_by(Contribution.epoch))
                return [(username, epoch, held, reason or "") for username, epoch, held, reason in rows]
        finally:
            engine.dispose()

    def held_reasons(self) -> dict[str, list[str]]:
        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                rows = session.execute(select(Contribution.username, Contribution.reason).where(Contribution.held > 0))
                found: dict[str, list[str]] = {}
                for username, reason in rows:
                    found.setdefault(username, []).append(reason or "")
                return found
        finally:
            engine.dispose()

    def plan_round_times(self) -> list[tuple]:
        """(fitted, measured, bandwidth-only predicted) seconds per round of every stored plan, oldest first."""
        from app.models import AveragingPlan

        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                return [tuple(row) for row in session.execute(select(
                    AveragingPlan.fitted_seconds, AveragingPlan.measured_seconds, AveragingPlan.predicted_seconds)
                    .order_by(AveragingPlan.id))]
        finally:
            engine.dispose()

    def plans(self) -> list[list[dict]]:
        """The peers of every averaging plan the coordinators published, oldest first."""
        from app.models import AveragingPlan

        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                return list(session.scalars(select(AveragingPlan.peers).order_by(AveragingPlan.id)))
        finally:
            engine.dispose()

    def spot_checks(self) -> int:
        """Spot-check rows (checks made and draws skipped) of every run."""
        from app.models import SpotCheck

        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                return session.scalar(select(func.count()).select_from(SpotCheck))
        finally:
            engine.dispose()

    def samples_by_epoch(self) -> dict[int, int]:
        """epoch -> samples every peer claimed for it, as the portal recorded the claims."""
        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                query = select(Contribution.epoch, func.sum(Contribution.samples)).group_by(Contribution.epoch)
                return {int(epoch): int(samples) for epoch, samples in session.execute(query)}
        finally:
            engine.dispose()

    def mini_steps_by_epoch(self) -> dict[int, int]:
        """epoch -> mini-steps every peer's claim for it says it trained, its round averaged them in or not."""
        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                query = select(Contribution.epoch, func.sum(Contribution.mini_steps)).group_by(Contribution.epoch)
                return {int(epoch): int(steps) for epoch, steps in session.execute(query)}
        finally:
            engine.dispose()

    def claims_in_database(self) -> dict[tuple[str, int], int]:
        """(username, epoch) -> samples of every claim the coordinators recorded."""
        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                rows = session.execute(select(Contribution.username, Contribution.epoch, Contribution.samples))
                return {(username, epoch): samples for username, epoch, samples in rows}
        finally:
            engine.dispose()

    def claim_rows(self) -> list[dict]:
        """Every claim the coordinators recorded: username, epoch, samples, held, reason and round (``group``)."""
        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                rows = session.execute(select(Contribution.username, Contribution.epoch, Contribution.samples,
                                              Contribution.held, Contribution.reason, Contribution.group_id))
                return [dict(username=username, epoch=epoch, samples=samples, held=held, reason=reason or "",
                             group=group) for username, epoch, samples, held, reason, group in rows]
        finally:
            engine.dispose()

    def rows_per_epoch(self) -> list[tuple[str, int, int]]:
        """(peer key, epoch, count) for every credited pair: a count above 1 would be double counting."""
        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                query = select(Contribution.peer_key, Contribution.epoch, func.count()).group_by(
                    Contribution.peer_key, Contribution.epoch
                )
                return [tuple(row) for row in session.execute(query)]
        finally:
            engine.dispose()
