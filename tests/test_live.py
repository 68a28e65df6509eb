"""Many dashboard viewers on a live portal: more event streams than the database pool has connections, while the
API, the peer-token endpoint and the pages keep answering (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from dedloc_common.signing import public_openssh

from app.core.database import make_engine, make_sessionmaker
from app.runs.registry import get_run
from app.runs.snapshots import record_snapshot

POOL = 3  # DEDLOC_DB_POOL_SIZE 2 + DEDLOC_DB_MAX_OVERFLOW 1
VIEWERS = 4 * POOL
UPDATES = (1_000_001, 1_000_002, 1_000_003)


class Watcher:
    """One dashboard viewer: what each event carried."""

    def __init__(self, url: str):
        self.url, self.status, self.totals, self.events = url, None, set(), {}

    async def watch(self, client: httpx.AsyncClient) -> None:
        async with client.stream("GET", self.url) as response:
            self.status = response.status_code
            self.retry_after = response.headers.get("retry-after")
            if response.status_code != 200:
                return
            name = None
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and name:
                    self.events[name] = self.events.get(name, 0) + 1
                    if name == "swarm":
                        self.totals.add(json.loads(line.split(":", 1)[1])["samples_total"])


async def until(check, timeout: float, what: str) -> None:
    for _ in range(int(timeout / 0.1)):
        if check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture
def live_portal(deployment, database_url):
    deployment.env.update({"DATABASE_URL": database_url, "DEDLOC_DB_POOL_SIZE": "2", "DEDLOC_DB_MAX_OVERFLOW": "1",
                           "DEDLOC_DB_POOL_TIMEOUT": "5", "DEDLOC_LIVE_INTERVAL": "0.3",
                           "DEDLOC_MAX_EVENT_STREAMS": str(VIEWERS)})
    deployment.database_url = database_url
    deployment.create_run()
    deployment.start_portal()
    return deployment


def test_many_viewers_do_not_stall_the_portal(live_portal):
    deployment = live_portal
    credential = deployment.credential("alice")
    key = public_openssh(rsa.generate_private_key(public_exponent=65537, key_size=2048)).decode()
    sessions = make_sessionmaker(make_engine(deployment.database_url))
    events_url = f"{deployment.url}/runs/{deployment.slug}/events"

    def write_snapshot(total: int) -> None:
        with sessions() as session:
            record_snapshot(session, get_run(session, deployment.slug), peers_online=1, samples_per_second=10.0,
                            epoch=total % 100, loss=2.0, samples_total=total, samples_accumulated=0,
                            eta_seconds=None)

    async def scenario() -> None:
        limits = httpx.Limits(max_connections=VIEWERS + 10)
        async with httpx.AsyncClient(base_url=deployment.url, timeout=15, limits=limits) as client:
            watchers = [Watcher(events_url) for _ in range(VIEWERS)]
            streams = [asyncio.create_task(w.watch(client)) for w in watchers]
            await until(lambda: all(w.events.get("swarm") for w in watchers), 20, "every viewer's first update")
            assert all(w.events.get("leaders") and w.events.get("plan") for w in watchers)

            # One viewer past the setting: refused with 503 and when to retry, not a 500 or a hang.
            extra = Watcher(events_url)
            await extra.watch(client)
            assert (extra.status, extra.retry_after) == (503, "30")

            for total in UPDATES:
                await asyncio.to_thread(write_snapshot, total)
                token = await client.post(f"/api/v1/runs/{deployment.slug}/peer-tokens", json={"public_key": key},
                                          headers={"Authorization": f"Bearer {credential}"})
                assert token.status_code == 200, token.text
                assert token.json()["token"]["username"] == "alice"
                swarm = await client.get(f"/api/v1/runs/{deployment.slug}/swarm")
                assert swarm.status_code == 200 and swarm.json()["samples_total"] == total
                page = await client.get(f"/runs/{deployment.slug}")
                assert page.status_code == 200 and f"{total:,}" in page.text
                await asyncio.sleep(0.5)

            await until(lambda: all(set(UPDATES) <= w.totals for w in watchers), 20, "every update at every viewer")
            assert not any(stream.done() for stream in streams), "a viewer was disconnected"
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)

            # The closed streams gave their places back.
            async def reconnects() -> bool:
                again = Watcher(events_url)
                task = asyncio.create_task(again.watch(client))
                await asyncio.sleep(0.5)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return again.status == 200

            for _ in range(20):
                if await reconnects():
                    break
            else:
                raise AssertionError("closed streams never gave their places back")

    try:
        asyncio.run(scenario())
    finally:
        sessions.kw["bind"].dispose()
    log = (deployment.logs / "portal.log").read_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
