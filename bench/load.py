"""Load on a deployment as in production: PostgreSQL, `dedloc serve --workers 2`, thousands of dashboard viewers.

    python -m bench.load [--viewers 1000 2500 5000 7500 10000] [--updates 5] [--api-concurrency 1 4 16 64]
                         [--peers 1000] [--out bench/results/load.json]

Three measurements on one throwaway PostgreSQL cluster, everything on loopback, the clients on the same cores. The
portal runs with its default settings (live interval, streams per process), as a deployment that sets nothing does.

1. **Viewers**: for each count N, N clients open `/runs/bench/events` (raw sockets: an HTTP client library per
   viewer would cost more than the portal), then a writer records a snapshot every coordinator poll interval (the
   default, 2 s), ``--updates`` times. A viewer *holds* when it received every one of those snapshots, each
   within 2 s of the snapshot's time.
2. **API reads**: for each concurrency, closed-loop clients GET a mix of public reads (run, swarm, leaderboard,
   history) for 10 s: reads per second, median and p99 latency.
3. **Coordinator**: the database work of one coordinator poll with ``--peers`` simulated peers' records
   (crediting their epoch, the snapshot, the averaging plan), timed as the coordinator does it; the DHT read
   itself is not included (its records would need that many RSA keys).

Results: ``load.json`` and ``load.md``; the method, in docs/benchmarks.md#load-bench.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import httpx

from app.core.config import Settings
from app.core.database import make_engine, make_sessionmaker
from app.core.processes import spawn, stop
from app.runs.registry import get_run
from app.runs.snapshots import record_snapshot
from bench import write_results
from bench.crediting import simulated_epoch
from tests.support.postgres import postgres_bin, throwaway_postgres

SLUG = "bench"
WITHIN = 2.0  # seconds from a snapshot to every viewer
READS = ("/api/v1/runs/bench", "/api/v1/runs/bench/swarm", "/api/v1/runs/bench/leaderboard",
         "/api/v1/runs/bench/history?limit=100")
CONNECT_AT_ONCE = 200  # viewers connecting at the same time (the listen backlog is 2048)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# viewers ---------------------------------------------------------------------------------------------------------

async def viewer(port: int, arrivals: dict, ready: asyncio.Semaphore, connected: list) -> None:
    """One dashboard's event stream over a plain socket; ``arrivals[samples_total]`` = seconds after its snapshot."""
    async with ready:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
            writer.write(f"GET /runs/{SLUG}/events HTTP/1.1\r\nHost: bench\r\nAccept: text/event-stream\r\n\r\n"
                         .encode())
            status = await asyncio.wait_for(reader.readline(), 30)
        except (OSError, asyncio.TimeoutError) as error:
            connected.append(type(error).__name__)
            return
    if b" 200 " not in status:
        connected.append(status.decode(errors="replace").strip()[:40])
        writer.close()
        return
    connected.append(200)
    event = None
    try:
        while line := await reader.readline():
            text = line.decode(errors="replace").strip()
            if text.startswith("event:"):
                event = text.split(":", 1)[1].strip()
            elif text.startswith("data:") and event == "swarm":
                swarm = json.loads(text.split(":", 1)[1])
                if swarm.get("updated_at"):
                    taken = datetime.fromisoformat(swarm["updated_at"]).timestamp()
                    arrivals.setdefault(swarm["samples_total"], time.time() - taken)
    except (OSError, ValueError):
        return
    finally:
        writer.close()


async def viewers_hold(port: int, database_url: str, count: int, updates: int) -> dict:
    sessions = make_sessionmaker(make_engine(database_url))
    ready, connected = asyncio.Semaphore(CONNECT_AT_ONCE), []
    arrivals = [dict() for _ in range(count)]
    started = time.perf_counter()
    tasks = [asyncio.create_task(viewer(port, a, ready, connected)) for a in arrivals]
    while len(connected) < count and time.perf_counter() - started < 120:
        await asyncio.sleep(0.2)
    connect_seconds = time.perf_counter() - started
    await asyncio.sleep(2)  # every stream's first event (the current swarm) is out of the way
    written, every = [], Settings().poll_interval  # as often as the coordinator writes one
    for n in range(updates):
        value = 10_000_000 + count * 100 + n
        with sessions() as session:
            record_snapshot(session, get_run(session, SLUG), peers_online=count, samples_per_second=1.0, epoch=n,
                            loss=1.0, samples_total=value, samples_accumulated=0, eta_seconds=None)
        written.append(value)
        await asyncio.sleep(every)
    await asyncio.sleep(WITHIN + 1)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    delays = [a[v] for a in arrivals for v in written if v in a]
    per_update = [{"received": sum(1 for a in arrivals if v in a),
                   "max_delay_s": round(max((a[v] for a in arrivals if v in a), default=float("nan")), 3)}
                  for v in written]
    held = sum(1 for a in arrivals if all(v in a and a[v] <= WITHIN for v in written))
    return {
        "viewers": count, "connected": connected.count(200), "connect_seconds": round(connect_seconds, 1),
        "refused": sorted({str(c) for c in connected if c != 200}), "held_every_update": held,
        "delay_median_s": round(statistics.median(delays), 3) if delays else None,
        "delay_max_s": round(max(delays), 3) if delays else None, "per_update": per_update,
    }


# API reads -------------------------------------------------------------------------------------------------------

async def read_response(reader: asyncio.StreamReader) -> int:
    """One HTTP/1.1 response on a kept-alive connection (the portal's JSON answers carry Content-Length)."""
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def api_reads(port: int, concurrency: int, seconds: float = 10.0) -> dict:
    """Closed-loop readers, each on one kept-alive socket: an HTTP client library costs more CPU per request
    than the portal does (httpx used a whole core at 64 readers here), and the clients share the portal's cores."""
    times, failures = [], 0
    deadline = time.perf_counter() + seconds

    async def loop(offset: int) -> None:
        nonlocal failures
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = offset
        try:
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                writer.write(f"GET {READS[i % len(READS)]} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
                failures += await read_response(reader) != 200
                times.append(time.perf_counter() - start)
                i += 1
        finally:
            writer.close()

    await asyncio.gather(*(loop(k) for k in range(concurrency)))
    ordered = sorted(times)
    return {"concurrency": concurrency, "reads_per_second": round(len(times) / seconds, 1),
            "median_ms": round(1000 * statistics.median(ordered), 1),
            "p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 1), "failures": failures}


# the coordinator's poll --------------------------------------------------------------------------------------------

def coordinator_poll(database_url: str, peers: int, repeats: int = 3) -> dict:
    """The database side of ``CoordinatorNode.poll_once`` for ``peers`` peers' records, each epoch in turn."""
    from app.coordinator.summary import PeerSeen, summarize
    from app.credit.ledger import samples_total
    from app.credit.settlement import credit_epochs

    sessions = make_sessionmaker(make_engine(database_url))
    times = []
    with sessions() as session:
        run = get_run(session, SLUG)
        for epoch in range(1, repeats + 1):
            records = simulated_epoch(session, run, peers, epoch)
            seen = [PeerSeen(m.peer_key, epoch + 1, 0, 100.0) for m in records]
            started = time.perf_counter()
            credit_epochs(session, run, records)
            fields = summarize(seen, records, run.target_batch_size, samples_total(session, run))
            record_snapshot(session, run, **fields)
            session.commit()
            times.append(time.perf_counter() - started)
    return {"peers": peers, "poll_median_s": round(statistics.median(times), 3), "poll_max_s": round(max(times), 3),
            "polls": len(times)}


# the deployment ----------------------------------------------------------------------------------------------------

def raise_file_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 65536
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))  # children (the portal) inherit it
    return wanted


def measure(args, database_url: str, workdir: Path) -> dict:
    port = free_port()
    # Nothing but where to serve: the portal's settings are the defaults (or what this shell's environment sets).
    env = {"DATABASE_URL": database_url, "DEDLOC_DATA_DIR": str(workdir), "DEDLOC_PORT": str(port)}
    settings = Settings()
    cli = [sys.executable, "-m", "app.cli"]
    subprocess.run([*cli, "create-run", SLUG], env={**os.environ, **env}, check=True, capture_output=True)
    log = workdir / "portal.log"
    portal = spawn([*cli, "serve", "--workers", "2"], log=log, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        reads = [asyncio.run(api_reads(port, c)) for c in args.api_concurrency]
        for row in reads:
            print("api", json.dumps(row), flush=True)
        viewers = []
        for count in args.viewers:
            row = asyncio.run(viewers_hold(port, database_url, count, args.updates))
            print("viewers", json.dumps(row), flush=True)
            viewers.append(row)
            if row["held_every_update"] < count:
                break  # the largest count that held is the one before
    finally:
        stop(portal)
    poll = coordinator_poll(database_url, args.peers)
    print("coordinator", json.dumps(poll), flush=True)
    text = log.read_text(errors="replace")
    return {"measured_at": datetime.now().astimezone().isoformat(timespec="seconds"), "web_processes": 2,
            "database": "PostgreSQL", "live_interval_s": settings.live_interval,
            "max_event_streams": settings.max_event_streams, "snapshot_every_s": settings.poll_interval,
            "cores": os.cpu_count(),
            "viewers": viewers, "api": reads, "coordinator": poll,
            "portal_errors_logged": text.count("Traceback") + text.count("ERROR")}


def markdown(result: dict) -> str:
    held = [r["viewers"] for r in result["viewers"] if r["held_every_update"] == r["viewers"]]
    fast = [r for r in result["api"] if r["p99_ms"] < 100]
    lines = [
        "# Load on a deployment: PostgreSQL, two web processes",
        "",
        f"Written by `python -m bench.load` on {result['measured_at']} ({result['cores']} cores; the clients, both",
        "web processes and PostgreSQL share them). The portal's settings as the environment left them (the defaults",
        f"unless set): live interval {result['live_interval_s']} s, {result['max_event_streams']:,} streams per "
        f"process; a snapshot every {result['snapshot_every_s']} s",
        "(the coordinator's poll interval). Method: docs/benchmarks.md#load-bench.",
        "",
        f"- Most dashboard viewers held (every update, each within {WITHIN:.0f} s): **{max(held) if held else 0:,}**",
        f"- API reads per second at p99 < 100 ms: **{max((r['reads_per_second'] for r in fast), default=0):,.0f}**",
        f"- Coordinator poll, {result['coordinator']['peers']:,} peers' records (database work): "
        f"**{result['coordinator']['poll_median_s']:.3f} s** median",
        f"- Errors in the portal's log: {result['portal_errors_logged']}",
        "",
        "| viewers | connected | held every update | delay median | delay max | connect time |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {r['viewers']:,} | {r['connected']:,} | {r['held_every_update']:,} | {r['delay_median_s']} s | "
              f"{r['delay_max_s']} s | {r['connect_seconds']} s |" for r in result["viewers"]]
    lines += ["", "| concurrent readers | reads/s | median | p99 | failures |", "| ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['concurrency']} | {r['reads_per_second']:,} | {r['median_ms']} ms | {r['p99_ms']} ms | "
              f"{r['failures']} |" for r in result["api"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n")[0])
    parser.add_argument("--viewers", type=int, nargs="+", default=[1000, 2500, 5000, 7500, 10000])
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--api-concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=Path("bench/results/load.json"))
    args = parser.parse_args(argv)
    bin_dir = postgres_bin()
    if bin_dir is None:
        print("load bench skipped: PostgreSQL server binaries are not installed (apt-get install postgresql)")
        return 0
    limit = raise_file_limit()
    if limit < max(args.viewers) + 1000:
        print(f"only {limit} open files allowed; viewer counts above {limit - 1000} will fail to connect")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dedloc-load-") as folder, \
            throwaway_postgres(bin_dir, "max_connections=200") as database_url:
        result = measure(args, database_url, Path(folder))
    write_results(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
