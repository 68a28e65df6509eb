"""How many dashboard viewers one portal process serves, and how fast its API answers meanwhile.

    python -m bench.viewers [--viewers 15 30 60 120 240] [--updates 6] [--out bench/results/viewers.json]

For each count: a fresh SQLite portal (`dedloc serve`, one process), N clients on `/runs/bench/events`, and a
writer that records a new swarm snapshot every second (as the coordinator does), ``--updates`` times. A viewer
*holds* when it received every one of those snapshots. Meanwhile a prober times `GET /api/v1/runs/bench/swarm`
(median, p99, failures). The portal's log is scanned for errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from app.core.database import make_engine, make_sessionmaker
from app.core.processes import spawn, stop
from app.runs.registry import get_run
from app.runs.snapshots import record_snapshot

SLUG = "bench"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def viewer(url: str, seen: set[int], stop_at: asyncio.Event, connected: list) -> None:
    """Read the event stream, remembering every ``samples_total`` it carried."""
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    connected.append(response.status_code)
                    return
                connected.append(200)
                event = None
                async for line in response.aiter_lines():
                    if stop_at.is_set():
                        return
                    if line.startswith("event:"):
                        event = line.split(":", 1)[1].strip()
                    elif line.startswith("data:") and event == "swarm":
                        seen.add(json.loads(line.split(":", 1)[1])["samples_total"])
    except httpx.HTTPError as error:
        connected.append(type(error).__name__)
    except asyncio.CancelledError:  # the end of the measurement, or a viewer still waiting for an answer
        if not connected or stop_at.is_set():
            return


async def prober(url: str, stop_at: asyncio.Event, times: list[float], failures: list[str]) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        while not stop_at.is_set():
            start = time.perf_counter()
            try:
                response = await client.get(url)
                if response.status_code != 200:
                    failures.append(str(response.status_code))
            except httpx.HTTPError as error:
                failures.append(type(error).__name__)
            times.append(time.perf_counter() - start)
            await asyncio.sleep(0.2)


async def measure(base: str, database_url: str, viewers: int, updates: int) -> dict:
    sessions = make_sessionmaker(make_engine(database_url))
    stop_at, connected = asyncio.Event(), []
    seen: list[set[int]] = [set() for _ in range(viewers)]
    tasks = [asyncio.create_task(viewer(f"{base}/runs/{SLUG}/events", s, stop_at, connected)) for s in seen]
    await asyncio.sleep(3)  # everyone connects (or fails to)
    times, failures = [], []
    probe = asyncio.create_task(prober(f"{base}/api/v1/runs/{SLUG}/swarm", stop_at, times, failures))
    written = []
    for n in range(updates):
        value = 1_000_000 + n
        with sessions() as session:
            record_snapshot(session, get_run(session, SLUG), peers_online=1, samples_per_second=1.0, epoch=n,
                            loss=1.0, samples_total=value, samples_accumulated=0, eta_seconds=None)
        written.append(value)
        await asyncio.sleep(1.0)
    await asyncio.sleep(3)  # the last update reaches everyone
    stop_at.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, probe, return_exceptions=True)
    held = sum(1 for s in seen if set(written) <= s)
    ordered = sorted(times)
    return {
        "viewers": viewers, "connected": connected.count(200), "held_every_update": held,
        "refused": sorted({str(c) for c in connected if c != 200}),
        "api_median_s": round(statistics.median(ordered), 4) if ordered else None,
        "api_p99_s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4) if ordered else None,
        "api_requests": len(ordered), "api_failures": len(failures),
    }


def run_one(viewers: int, updates: int) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="dedloc-viewers-"))
    port = free_port()
    env = {"DEDLOC_DATA_DIR": str(workdir), "DEDLOC_PORT": str(port), "DEDLOC_LIVE_INTERVAL": "0.5",
           "DATABASE_URL": ""}
    database_url = f"sqlite:///{workdir / 'dedloc.sqlite3'}"
    cli = [sys.executable, "-m", "app.cli"]
    import subprocess

    subprocess.run([*cli, "create-run", SLUG], env={**os.environ, **env}, check=True, capture_output=True)
    log = workdir / "portal.log"
    portal = spawn([*cli, "serve"], log=log, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        row = asyncio.run(measure(base, database_url, viewers, updates))
    finally:
        stop(portal)
    text = log.read_text(errors="replace")
    row["server_errors_logged"] = text.count("Traceback") + text.count("ERROR")
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.viewers", description=__doc__.split("\n")[0])
    parser.add_argument("--viewers", type=int, nargs="+", default=[15, 30, 60, 120, 240])
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("bench/results/viewers.json"))
    args = parser.parse_args(argv)
    rows = []
    for count in args.viewers:
        row = run_one(count, args.updates)
        print(json.dumps(row))
        rows.append(row)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
