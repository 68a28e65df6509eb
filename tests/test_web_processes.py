"""`dedloc serve --workers 2`: two web processes on one port and one database share everything a visitor or a
worker relies on. Each request below is sent on a connection the test knows the serving process of (the kernel
says which process holds the socket), so "started on one, finished on the other" is what happens, not luck."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from app.core.database import make_engine, make_sessionmaker
from app.runs import registry
from app.runs.snapshots import record_snapshot
from tests.support.harness import wait_for
from tests.support.portal import form_token

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
TOKENS_PER_MINUTE = 3


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def web_processes(leader: int) -> list[int]:
    """uvicorn's worker processes: the children of `dedloc serve` that run the app (not multiprocessing's
    resource tracker)."""
    return [pid for pid in children(leader) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def serving_process(client_port: int, server_port: int, candidates: list[int]) -> int | None:
    """Which of ``candidates`` holds the server side of the loopback connection from ``client_port``."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if (int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)) == (server_port,
                                                                                                 client_port):
                inode = fields[9]
    for pid in candidates:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    return None


class Portal:
    def __init__(self, url: str, leader: int):
        self.url, self.port = url, int(url.rsplit(":", 1)[1])
        self.processes = wait_for(lambda: (lambda found: found if len(found) == 2 else None)(web_processes(leader)),
                                  30, "two web processes")

    @contextmanager
    def on(self, pid: int, **options):
        """An httpx client whose (kept-alive) connection the web process ``pid`` serves."""
        for _ in range(200):
            client = httpx.Client(base_url=self.url, timeout=15, **options)
            answer = client.get("/healthz")
            assert answer.status_code == 200
            port = answer.extensions["network_stream"].get_extra_info("client_addr")[1]
            if serving_process(port, self.port, self.processes) == pid:
                try:
                    yield client
                finally:
                    client.close()
                return
            client.close()
        raise AssertionError(f"no connection landed on process {pid} in 200 tries")


def sign_in(client: httpx.Client, username: str) -> None:
    token = form_token(client.get("/signin").text)
    done = client.post("/signin/dev", data={"username": username, "csrf": token, "next": "/me"})
    assert done.status_code == 303, done.text


def openssh_key() -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def next_swarm_event(lines, epoch: int, timeout: float = 15) -> dict:
    """Read a dashboard's event stream up to the swarm update that shows ``epoch``."""
    deadline, event = time.monotonic() + timeout, None
    for line in lines:
        if line.startswith("event:"):
            event = line.split(":", 1)[1].strip()
        elif line.startswith("data:") and event == "swarm":
            swarm = json.loads(line.split(":", 1)[1])
            if swarm["epoch"] == epoch:
                return swarm
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"no swarm event with epoch {epoch}")


def test_two_web_processes_share_sessions_logins_limits_events_and_metrics(deployment, database_url):
    deployment.database_url = database_url
    deployment.env.update(DATABASE_URL=database_url, DEDLOC_PEER_TOKEN_REQUESTS_PER_MINUTE=str(TOKENS_PER_MINUTE))
    deployment.create_run()
    proc = deployment.start("portal", "-m", "app.cli", "serve", "--workers", "2")
    wait_for(lambda: httpx.get(f"{deployment.url}/healthz").status_code == 200, 60, "the portal")
    portal = Portal(deployment.url, proc.pid)
    first, second = portal.processes

    # A session cookie signed by one process is honoured by the other.
    with portal.on(first) as browser:
        sign_in(browser, "alice")
        cookies = dict(browser.cookies)
    with portal.on(second, cookies=cookies) as browser:
        page = browser.get("/me")
        assert page.status_code == 200 and "alice" in page.text

    # A device login started on one process is approved on the other, and redeemed on the first.
    with portal.on(first) as worker:
        started = worker.post("/api/v1/device/code", data={"client_name": "laptop"}).json()
        with portal.on(second, cookies=cookies) as browser:
            token = form_token(browser.get("/device", params={"user_code": started["user_code"]}).text)
            approved = browser.post("/device", data={"user_code": started["user_code"], "decision": "approve",
                                                     "csrf": token})
            assert approved.status_code == 200, approved.text
        grant = worker.post("/api/v1/device/token", data={"grant_type": DEVICE_GRANT,
                                                          "device_code": started["device_code"]})
        assert grant.status_code == 200, grant.text
    bearer = {"Authorization": f"Bearer {grant.json()['access_token']}"}
    for pid in (first, second):
        with portal.on(pid, headers=bearer) as worker:
            assert worker.get("/api/v1/me").json()["username"] == "alice"

    # The per-account token rate holds across both: the requests alternate, the one past the limit is refused.
    answers = []
    for i in range(TOKENS_PER_MINUTE + 1):
        with portal.on((first, second)[i % 2], headers=bearer) as worker:
            answers.append(worker.post(f"/api/v1/runs/{deployment.slug}/peer-tokens",
                                       json={"public_key": openssh_key()}))
    assert [a.status_code for a in answers] == [200] * TOKENS_PER_MINUTE + [429], answers[-1].text
    assert int(answers[-1].headers["Retry-After"]) > 0

    # A viewer on each process sees the same update; /metrics answers the same on both.
    with portal.on(first) as one, portal.on(second) as other:
        with one.stream("GET", f"/runs/{deployment.slug}/events") as a, \
                other.stream("GET", f"/runs/{deployment.slug}/events") as b:
            lines_a, lines_b = a.iter_lines(), b.iter_lines()
            engine = make_engine(database_url)
            with make_sessionmaker(engine)() as session:
                record_snapshot(session, registry.get_run(session, deployment.slug), peers_online=3,
                                samples_per_second=42.0, epoch=7, loss=2.5, samples_total=700,
                                samples_accumulated=0, eta_seconds=None)
            engine.dispose()
            seen = [next_swarm_event(lines_a, 7), next_swarm_event(lines_b, 7)]
        assert seen[0] == seen[1] and seen[0]["peers_online"] == 3
        metrics = [one.get("/metrics").text, other.get("/metrics").text]
    assert metrics[0] == metrics[1]
    assert f'dedloc_epoch{{run="{deployment.slug}"}} 7.0' in metrics[0]


def test_processes_starting_together_read_one_secret_key(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from app.core.config import Settings
    from app.core.secrets import secret_key

    settings = Settings(data_dir=tmp_path / "data")
    with ThreadPoolExecutor(8) as pool:
        keys = set(pool.map(lambda _: secret_key(settings), range(32)))
    assert len(keys) == 1 and len(keys.pop()) >= 32
    assert [path.name for path in (tmp_path / "data").iterdir()] == ["secret.key"]
