"""``dedloc demo``: portal, coordinator and local workers on loopback, until Ctrl-C ends them all."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx

from dedloc_worker.join import CREDENTIAL_ENV

from app.core.config import Settings
from app.core.errors import DedlocError
from app.core.processes import spawn, stop

DEMO_RUN = "demo"
VOLUNTEERS = ["alice", "bob", "carol", "dave"]


def check_alive(started) -> None:
    if any(proc.poll() is not None for proc in started):
        raise DedlocError("a demo process exited unexpectedly; see its messages above")


def wait_until(check, timeout: float, what: str, started, done: threading.Event) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done.is_set():
        check_alive(started)
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        done.wait(0.3)
    if not done.is_set():
        raise DedlocError(f"{what} did not come up within {timeout:.0f} s; see the messages above")


def issue_credential(py: str, username: str) -> str:
    """A worker credential for a local volunteer, as an operator issues one for a headless machine."""
    done = subprocess.run([py, "-m", "app.cli", "issue-credential", username], capture_output=True, text=True)
    if done.returncode != 0:
        raise DedlocError(f"could not issue a credential for {username}: {done.stderr.strip()}")
    return done.stdout.strip()


def port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex((host, port)) != 0


def run_demo(settings: Settings, workers: int) -> None:
    if not port_free(settings.host, settings.port):
        raise DedlocError(f"port {settings.port} on {settings.host} is taken; stop what uses it or set DEDLOC_PORT")
    url = f"http://{settings.host}:{settings.port}"
    py = sys.executable
    started = []
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    try:
        create = spawn([py, "-m", "app.cli", "create-run", DEMO_RUN, "--title", "Demo: a tiny language model",
                        "--if-missing"])
        if create.wait() != 0:
            raise DedlocError("could not create the demo run")
        started.append(spawn([py, "-m", "app.cli", "serve"]))
        started.append(spawn([py, "-m", "app.cli", "coordinator", "--run", DEMO_RUN]))
        wait_until(lambda: httpx.get(f"{url}/api/v1/runs/{DEMO_RUN}/join").json()["initial_peers"], 60,
                   "the portal and the coordinator", started, done)
        for name in VOLUNTEERS[:workers] if not done.is_set() else []:
            credential = issue_credential(py, name)
            started.append(spawn([py, "-m", "dedloc_worker", "join", url, "--run", DEMO_RUN,
                                  "--listen", "/ip4/127.0.0.1/tcp/0"], env={CREDENTIAL_ENV: credential}))
        print(f"\n  dedloc demo is running: open {url}/runs/{DEMO_RUN}\n  Ctrl-C stops everything.\n", flush=True)
        while not done.wait(1.0):
            check_alive(started)
    finally:
        print("stopping the demo...", flush=True)
        for proc in reversed(started):  # workers leave first, then the coordinator, then the portal
            stop(proc)
        print("demo stopped; nothing left running", flush=True)
