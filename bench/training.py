"""Training throughput: an N-peer swarm against N solo processes of the same task, threads and batch, on the same
cores, in one run (docs/benchmarks.md#training).

    python -m bench.training [--seconds 40] [--out bench/results/training.json]
    python -m bench.training --task tiny-lm --targets 2048,4096,16384 --out bench/results/training_epochs.json
    python -m bench.training --device cuda ...   # workers and solo processes on the GPU

Without ``--targets`` it runs ``CONFIGS``; with them, the run's defaults for ``--task`` at each global batch: a swarm
pays a fixed cost per epoch, and the table fits it (``epoch_cost``).

Solo: N processes train the task alone at once (no hivemind), each counting its samples over the window, right
before and right after each swarm row, the two averaged (the solo rate drifts between minutes here). Each takes an
optimizer step per swarm peer's share of the global batch, as a worker does (once per epoch).
Swarm: a portal (idle: workers ask it for their token at join, then only every half-hour), the run's coordinator
and N workers on loopback; the swarm's rate is what it turns into optimizer steps: epochs completed over the
window times the global batch. Efficiency = swarm / solo. Rows go to ``training.json`` and ``training.md``.

On a volunteer's machine a worker has the cores to itself; here the coordinator and the portal take some of the
same two. So each row also reports the CPU (cores, from ``/proc``) that the workers' process trees (their DHT,
averagers and p2pd included), the coordinator with the portal, and the solo processes used over their windows, and
``efficiency_per_cpu``: the swarm's samples per CPU-second of its workers over the solo processes' samples per
CPU-second. It counts what a worker spends besides its gradients, not the time a worker waits idle (for a round
it cannot overlap): that stays in ``efficiency``. ``efficiency_servers_apart`` keeps that idle time and everything
the workers' trees spend, and takes out only the servers' share: the solo rate scaled to the cores the coordinator
and the portal left the swarm (on CPU, where both solo processes are bound by the cores they get).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from dedloc_common.contract import LOOPBACK_OPTIMIZER, OptimizerOptions
from dedloc_worker.terminal import NO_GROUP, PART_LATE, RESULTS_LATE

from app.cli.demo import DEMO_TASK, write_corpus
from app.core.processes import group_members, spawn, stop_all
from bench import write_results

RESULTS = Path("bench/results")
PEERS = 2
BATCH = 16
TASKS = {
    "tiny-lm": dict(task="tiny-lm", options={}, files=False),
    "albert": dict(task="masked-lm", options=DEMO_TASK, files=True),
}
# (task, global batch, DPU, compression); the first row is a run's defaults, the next two change DPU and compression.
# Global batches large enough that a step is seconds of compute (the paper's 4096); a swarm pays a fixed cost per
# epoch (a round, matchmaking, progress and metrics records), so the last row takes tiny-lm's epoch four times as
# long, nearer real runs' minutes.
DEFAULTS = OptimizerOptions()
CONFIGS = [("tiny-lm", 4096, DEFAULTS.delay_optimizer_step, DEFAULTS.compression),
           ("tiny-lm", 4096, not DEFAULTS.delay_optimizer_step, DEFAULTS.compression),
           ("tiny-lm", 4096, DEFAULTS.delay_optimizer_step, "none" if DEFAULTS.compression != "none" else "fp16"),
           ("albert", 1024, DEFAULTS.delay_optimizer_step, DEFAULTS.compression),
           ("tiny-lm", 16384, DEFAULTS.delay_optimizer_step, DEFAULTS.compression)]
# A worker's lines for a round that lost parts (dedloc_worker.terminal's, by their text after the percentage): its
# epoch still counts, averaged in part.
PARTIAL = re.compile("|".join(re.escape(line.split("% ", 1)[1]) for line in (PART_LATE, RESULTS_LATE)))
# A worker prints this line as it enters epoch N.
EPOCH_LINE = re.compile(r"^epoch (\d+) \|", re.MULTILINE)
LOSS_LINE = re.compile(r"last epoch's loss ([0-9.]+)")  # dedloc_worker.progress's line, "n/a" before a first epoch
# The efficiency the bench's fit reports the global batch for.
GOAL = 0.85


def solo_rate(task: str, target: int, seconds: float, corpus: Path, device: str = "cpu") -> tuple[float, float]:
    """(samples per second, cores used) of PEERS solo processes training at once, each summed over them."""
    procs = [subprocess.Popen([sys.executable, "-m", "bench.training", "solo", task, str(target), str(seconds),
                               str(corpus), device], stdout=subprocess.PIPE, text=True) for _ in range(PEERS)]
    measured = [proc.communicate(timeout=seconds + 300)[0].split()[-2:] for proc in procs]
    return sum(float(rate) for rate, _ in measured), sum(float(cores) for _, cores in measured)


def solo_main(task_name: str, target: int, seconds: float, corpus: Path, device: str) -> None:
    import torch
    from dedloc_common.contract import RunConfig
    from dedloc_worker.tasks import build_task
    from dedloc_worker.training import device as devices

    torch.set_num_threads(1)
    spec = TASKS[task_name]
    files = {}
    if spec["files"]:
        from dedloc_common.tasks import validate_task

        from app.runs import files as run_files

        options = validate_task(spec["task"], spec["options"])
        stored = run_files.add_run_files(corpus / "solo-data" / str(os.getpid()), "solo", spec["task"], options,
                                         {"train.txt": corpus / "train.txt", "eval.txt": corpus / "eval.txt"})
        files = {f.name: run_files.path_of(corpus / "solo-data" / str(os.getpid()), "solo", f.name) for f in stored}
    config = RunConfig(slug="solo", run_id="solo", task=spec["task"], task_options=spec["options"],
                       target_batch_size=target, batch_size=BATCH)
    task = build_task(config, files)
    placement = devices.choose(device, 1)  # as the workers place theirs (--device, mixed precision on a GPU)
    task.to(placement.device, placement.amp)
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=1e-3)
    sync = torch.cuda.synchronize if placement.device == "cuda" else lambda: None
    for _ in range(3):  # warm up (first batches load data)
        task.batch_loss(BATCH).backward()
        optimizer.zero_grad()
    # A step per swarm peer's share of the global batch, as each worker takes one step per epoch: stepping after
    # every mini-batch costs tiny-lm a tenth of its rate (1,087 against 1,201 samples/s, one process here).
    batches_per_step = max(1, target // (PEERS * BATCH))
    sync()
    samples, start, cpu = 0, time.monotonic(), time.process_time()
    while time.monotonic() - start < seconds:
        task.batch_loss(BATCH).backward()
        samples += BATCH
        if samples % (batches_per_step * BATCH) == 0:
            optimizer.step()
            optimizer.zero_grad()
    sync()
    wall = time.monotonic() - start
    print(samples / wall, (time.process_time() - cpu) / wall)


def swarm_rate(task_name: str, target: int, dpu: bool, compression: str, seconds: float, corpus: Path,
               device: str = "cpu", spec: dict | None = None, batch: int = BATCH,
               during: Callable[[list[int], float], dict] | None = None, checkpoints: dict | None = None) -> dict:
    """The swarm's row: ``spec`` (as ``TASKS``' entries) instead of ``TASKS[task_name]``, ``batch`` samples per
    mini-step, ``checkpoints`` options over the run's (no checkpoint within the bench); ``during(worker pids,
    seconds)`` spends the window in place of a sleep, and what it returns joins the row (bench.gpu reads the workers'
    memory there)."""
    spec = spec or TASKS[task_name]
    work = Path(tempfile.mkdtemp(prefix="dedloc-bench-"))
    port = free_port()
    env = {"DEDLOC_DATA_DIR": str(work / "var"), "DEDLOC_PORT": str(port), "DATABASE_URL": ""}
    url = f"http://127.0.0.1:{port}"
    optimizer = {**LOOPBACK_OPTIMIZER, "delay_optimizer_step": dpu, "delay_grad_averaging": dpu,
                 "compression": compression}
    create = [sys.executable, "-m", "app.cli", "create-run", "bench", "--task", spec["task"], "--task-options",
              json.dumps(spec["options"]), "--target-batch-size", str(target), "--batch-size",
              str(batch), "--optimizer", json.dumps(optimizer),
              "--checkpoints", json.dumps({"every_epochs": 10**6, **(checkpoints or {})})]
    if spec["files"]:
        create += ["--file", str(corpus / "train.txt"), "--file", str(corpus / "eval.txt")]
    subprocess.run(create, env={**os.environ, **env}, check=True, capture_output=True)
    quiet = dict(log=work / "bench.log", env=env)
    started = [spawn([sys.executable, "-m", "app.cli", "serve"], **quiet),
               spawn([sys.executable, "-m", "app.cli", "coordinator", "--run", "bench"], **quiet)]
    try:
        wait(lambda: httpx.get(f"{url}/api/v1/runs/bench/join").json()["initial_peers"], 90)
        for index in range(PEERS):
            credential = subprocess.run([sys.executable, "-m", "app.cli", "issue-credential", f"peer{index}"],
                                        env={**os.environ, **env}, capture_output=True, text=True).stdout.strip()
            started.append(spawn([sys.executable, "-m", "dedloc_worker", "join", url, "--run", "bench", "--threads",
                                  "1", "--device", device, "--listen", "/ip4/127.0.0.1/tcp/0"],
                                 log=work / f"peer{index}.log", env={**env, "DEDLOC_WORKER_CREDENTIAL": credential}))
            if index == 0:  # one founder (docs/hivemind.md#state-checkpoints-and-resume)
                wait(lambda: swarm(url)["epoch"] >= 1, 300)
        wait(lambda: swarm(url)["peers_online"] >= PEERS, 300)
        # The window runs between two epoch boundaries as the founder's log shows them (a line as it enters each
        # epoch), read every 50 ms: the portal's epoch follows the coordinator's 2 s poll.
        log = work / "peer0.log"
        first = logged_epoch(log)
        wait(lambda: logged_epoch(log) > first, 300, poll=0.05)
        workers, servers = [proc.pid for proc in started[2:]], [proc.pid for proc in started[:2]]
        begin, t0, cpu0 = logged_epoch(log), time.monotonic(), (tree_cpu(workers), tree_cpu(servers))
        window_began = time.time()
        watched = during(workers, seconds) if during else {}
        if during is None:
            time.sleep(seconds)
        last = logged_epoch(log)
        wait(lambda: logged_epoch(log) > last, 300, poll=0.05)
        end, t1, cpu1 = logged_epoch(log), time.monotonic(), (tree_cpu(workers), tree_cpu(servers))
        window_ended = time.time()
        # The window's epochs in each worker's log: a round lost at a peer's joining, before it, does not count.
        logs = [(work / f"peer{i}.log").read_text() for i in range(PEERS)]
        sections = [text for log_text in logs for number, text in epoch_sections(log_text) if begin <= number < end]
        claimed = claimed_per_epoch(env, begin, end)
        checks = spot_checks_within(env, window_began, window_ended)
        stopped = ctrl_c(started[-1])
        return dict(swarm_samples_per_second=round((end - begin) * target / (t1 - t0), 1),
                    epochs=end - begin, epoch_seconds=round((t1 - t0) / (end - begin), 2),
                    failed_rounds=sum(text.count(NO_GROUP) for text in sections),
                    claimed_samples_per_epoch=claimed,
                    partial_rounds=sum(1 for text in sections if PARTIAL.search(text)),
                    spot_checks=checks,
                    workers_cores=round((cpu1[0] - cpu0[0]) / (t1 - t0), 3),
                    coordinator_and_portal_cores=round((cpu1[1] - cpu0[1]) / (t1 - t0), 3),
                    ctrl_c_seconds=stopped, worker_losses=[logged_losses(text) for text in logs], **watched)
    finally:
        stop_all(started[2:])
        stop_all(started[:2])
        shutil.rmtree(work, ignore_errors=True)


def servers_apart(row: dict, cores: int) -> float | None:
    """Efficiency with the coordinator's and the portal's CPU taken out: swarm / (solo x the share of ``cores`` they
    left). On a volunteer's machine neither runs beside the worker; here both take theirs from the same cores, and a
    spot check (2% of the swarm's compute, docs/spot-checks.md#cost) runs in the coordinator. None on a GPU, where
    the solo rate is not bound by the CPU."""
    if row.get("device", "cpu") != "cpu":
        return None
    left = (cores - row["coordinator_and_portal_cores"]) / cores
    return round(row["swarm_samples_per_second"] / (row["solo_samples_per_second"] * left), 3)


def bench_database(env: dict) -> str:
    """The database URL of the bench's run, as its portal and coordinator resolve it from ``env``."""
    from app.core.config import Settings

    return Settings(data_dir=env["DEDLOC_DATA_DIR"], DATABASE_URL=env["DATABASE_URL"]).resolved_database_url


def claimed_per_epoch(env: dict, first: int, end: int, timeout: float = 15.0) -> float | None:
    """The samples the workers claimed per epoch (summed over them, averaged over the window's epochs ``first`` to
    ``end - 1`` for which the coordinator recorded every worker's claim within ``timeout``). An epoch ends when the
    swarm's extrapolated progress reaches the global batch, so what it held can be a little less or more."""
    from sqlalchemy import func, select

    from app.core.database import one_session
    from app.models import Contribution

    url = bench_database(env)
    query = (select(func.sum(Contribution.samples)).where(Contribution.epoch >= first, Contribution.epoch < end)
             .group_by(Contribution.epoch).having(func.count(Contribution.peer_key.distinct()) == PEERS))
    deadline = time.monotonic() + timeout
    while True:  # claims reach the coordinator with the workers' metrics records, seconds after their epoch
        with one_session(url, migrate_first=False) as session:
            sums = session.scalars(query).all()
        if len(sums) >= end - first or time.monotonic() > deadline:
            return round(sum(sums) / len(sums), 1) if sums else None
        time.sleep(1)


def spot_checks_within(env: dict, began: float, ended: float) -> int:
    """Spot checks the coordinator finished between ``began`` and ``ended`` (unix seconds): each recomputed a peer's
    epoch on one of the cores the swarm trains on, so a window that holds one reads lower
    (docs/benchmarks.md#training)."""
    from datetime import datetime, timezone

    from sqlalchemy import func, select

    from app.core.database import one_session
    from app.models import SpotCheck

    url = bench_database(env)
    began_at, ended_at = (datetime.fromtimestamp(t, timezone.utc) for t in (began, ended))
    with one_session(url, migrate_first=False) as session:
        return session.scalar(select(func.count(SpotCheck.id)).where(SpotCheck.checked_at >= began_at,
                                                                     SpotCheck.checked_at <= ended_at))


def tree_cpu(roots: list[int]) -> float:
    """CPU-seconds (user + system) so far of the live processes in the trees under ``roots``. A process that ends
    between two readings loses its share: in a steady swarm none does."""
    from dedloc_common.cleanup import descendants

    total, ticks = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in {pid for root in roots for pid in [root, *descendants(root)]}:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def ctrl_c(worker: subprocess.Popen, timeout: float = 30.0) -> float | None:
    """Seconds from Ctrl-C (SIGINT, as a terminal sends it) on a training worker until it and every process it
    started have ended; None past ``timeout``."""
    start = time.monotonic()
    worker.send_signal(signal.SIGINT)
    while time.monotonic() - start < timeout:
        if worker.poll() is not None and not group_members(worker.pid):
            return round(time.monotonic() - start, 2)
        time.sleep(0.05)
    return None


def epoch_sections(log: str) -> list[tuple[int, str]]:
    """(N, what the worker logged from its "epoch N" line to the next) for each epoch its log announced: a round's
    warnings ("a part came late", "no group") fall in the section of the epoch they were printed in."""
    starts = list(EPOCH_LINE.finditer(log))
    ends = [found.start() for found in starts[1:]] + [len(log)]
    return [(int(found[1]), log[found.start():stop]) for found, stop in zip(starts, ends)]


def logged_losses(log: str) -> list[float] | None:
    """[first, last] of the epoch losses a worker's log printed ("last epoch's loss X"); None before it printed one."""
    losses = [float(found) for found in LOSS_LINE.findall(log)]
    return [losses[0], losses[-1]] if losses else None


def logged_epoch(log: Path) -> int:
    """The epoch a worker's log announced last (its "epoch N | ..." lines, printed as it enters epoch N)."""
    sections = epoch_sections(log.read_text())
    return sections[-1][0] if sections else 0


def swarm(url: str) -> dict:
    return httpx.get(f"{url}/api/v1/runs/bench/swarm", timeout=10).json()


def wait(check, timeout: float, poll: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(poll)
    raise RuntimeError(f"the bench swarm did not get there within {timeout:.0f} s")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def markdown(rows: list[dict]) -> str:
    devices = sorted({r.get("device", "cpu") for r in rows})
    lines = ["# Training throughput: swarm vs solo", "",
             f"Written by `python -m bench.training`: {PEERS} workers (one torch thread each, on "
             f"{' and '.join(devices)}) with the run's coordinator and an idle portal, against",
             f"{PEERS} solo processes at once, batch {BATCH}, same cores; window and method: "
             "docs/benchmarks.md#training.", "",
             "| task | global batch | epoch, s | peers | dpu | compression | swarm samples/s | "
             "solo samples/s (before / after) | efficiency | cores: workers / coordinator and portal / solo | "
             "efficiency per CPU | efficiency, servers' cores apart | epochs | samples claimed per epoch | "
             "failed rounds | partial rounds | spot checks | Ctrl-C on a worker, s |",
             "|" + " --- |" * 18]
    lines += [f"| {r['task']} | {r['target_batch_size']:,} | {r['epoch_seconds']} | {r['peers']} | "
              f"{'on' if r['dpu'] else 'off'}{' (default)' if r['dpu'] == DEFAULTS.delay_optimizer_step else ''} | "
              f"{r['compression']} | "
              f"{r['swarm_samples_per_second']:,.0f} | {r['solo_samples_per_second']:,.0f} "
              f"({' / '.join(f'{v:,.0f}' for v in r['solo_before_and_after'])}) | {r['efficiency']:.2f} | "
              f"{r['workers_cores']:.2f} / {r['coordinator_and_portal_cores']:.2f} / {r['solo_cores']:.2f} | "
              f"{r['efficiency_per_cpu']:.2f} | {shown(r.get('efficiency_servers_apart'), '.2f')} | {r['epochs']} | "
              f"{shown(r.get('claimed_samples_per_epoch'), ',.0f')} | "
              f"{r['failed_rounds']} | {r.get('partial_rounds')} | {r.get('spot_checks', '-')} | "
              f"{r.get('ctrl_c_seconds')} |"
              for r in rows]
    fits = epoch_cost(rows)
    if fits:
        lines += ["", "Fixed cost per epoch, fitted over the rows of one task and settings at several global batches "
                  "(1 / efficiency = a + b / global batch, least squares): the efficiency of long epochs is 1 / a, and "
                  "each epoch costs b samples of solo compute on top.", ""]
        lines += [f"- {fit}" for fit in fits]
    return "\n".join(lines) + "\n"


def shown(value: float | None, spec: str) -> str:
    """A table cell: ``value`` formatted by ``spec``, or "-" where a row has none (older rows, a GPU's)."""
    return "-" if value is None else format(value, spec)


def epoch_cost(rows: list[dict]) -> list[str]:
    """One line per (task, device, DPU, compression) measured at three or more global batches: the fit of
    1/efficiency = a + b/B. A swarm's time per epoch is then (a * B + b) / solo rate: b / solo is what an epoch costs
    beyond its samples' compute, in seconds of the whole machine."""
    import statistics

    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["task"], row.get("device", "cpu"), row["dpu"], row["compression"])
        groups.setdefault(key, []).append(row)
    fits = []
    for (task, device, dpu, compression), group in groups.items():
        if len({r["target_batch_size"] for r in group}) < 3:  # two noisy rows fit anything
            continue
        b, a = statistics.linear_regression([1 / r["target_batch_size"] for r in group],
                                            [1 / r["efficiency"] for r in group])
        solo = statistics.fmean(r["solo_samples_per_second"] for r in group)
        if b <= 0:
            fits.append(f"{task} on {device}: the rows show no cost per epoch above their scatter")
            continue
        needed = f"{b / (1 / GOAL - a):,.0f} samples" if 1 / GOAL > a else "none (long epochs stay below it)"
        fits.append(f"{task} on {device}, DPU {'on' if dpu else 'off'}, compression {compression}: efficiency at long "
                    f"epochs {1 / a:.2f}; each epoch costs {b:,.0f} samples ({b / solo:.2f} s of the machine at "
                    f"{solo:,.0f} samples/s solo); {GOAL} needs a global batch of {needed}")
    return fits


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "solo":
        solo_main(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), Path(sys.argv[5]), sys.argv[6])
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.training")
    parser.add_argument("--seconds", type=float, default=40.0, help="measurement window per configuration")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where workers and solo train")
    parser.add_argument("--task", choices=sorted(TASKS), default="tiny-lm", help="the task of --targets")
    parser.add_argument("--targets", help="global batches, comma-separated: the run's defaults for --task at each, "
                                          "instead of the standard rows; repeat one to measure it again")
    parser.add_argument("--compressions", default=DEFAULTS.compression,
                        help="with --targets: gradient compressions, comma-separated (none, fp16, uint8), each "
                             "measured at every global batch in turn")
    parser.add_argument("--out", type=Path, default=RESULTS / "training.json")
    args = parser.parse_args(argv)
    try:
        configs = ([(args.task, int(t), DEFAULTS.delay_optimizer_step, c)
                    for t in args.targets.split(",") for c in args.compressions.split(",")]
                   if args.targets else CONFIGS)
    except ValueError:
        parser.error(f"--targets {args.targets!r}: give global batches as whole numbers, like 4096,16384")
    known = OptimizerOptions.model_fields["compression"].annotation.__args__
    if any(c not in known for _, _, _, c in configs):
        parser.error(f"--compressions {args.compressions!r}: choose from {', '.join(known)}")
    corpus = Path(tempfile.mkdtemp(prefix="dedloc-bench-corpus-"))
    write_corpus(corpus)
    rows = []
    try:
        for task, target, dpu, compression in configs:
            # Solo right before and right after each swarm, averaged: this machine's solo rate drifts by up to 15%
            # within minutes (and 16% between runs), so a ratio takes both halves from the same minutes.
            before = solo_rate(task, target, args.seconds, corpus, args.device)
            measured = swarm_rate(task, target, dpu, compression, args.seconds, corpus, args.device)
            after = solo_rate(task, target, args.seconds, corpus, args.device)
            solo, solo_cores = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
            row = dict(task=task, target_batch_size=target, peers=PEERS, device=args.device, dpu=dpu,
                       compression=compression, solo_samples_per_second=round(solo, 1),
                       solo_before_and_after=[round(before[0], 1), round(after[0], 1)],
                       solo_cores=round(solo_cores, 3), **measured)
            row["efficiency"] = round(row["swarm_samples_per_second"] / solo, 3)
            row["efficiency_per_cpu"] = round(row["swarm_samples_per_second"] / row["workers_cores"]
                                              / (solo / solo_cores), 3)
            row["efficiency_servers_apart"] = servers_apart(row, os.cpu_count() or 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(corpus, ignore_errors=True)
    write_results(args.out, rows, markdown(rows))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
