"""Ctrl-C on every worker of a swarm at once: seconds until each has exited (docs/benchmarks.md#leaving).

    python -m bench.leave [--trials 6] [--out bench/results/leave.json]

Each trial starts two trainers and an auxiliary peer (``--aux``) in one run with its portal and coordinator, lets
them train, then sends SIGINT to all three together, at a moment that moves by a fraction of an epoch from trial to
trial (a round forming, running, or none), and times each exit. Volunteers leave together when a demo or a
test ends; the partners a leaving peer waits for are then leaving too.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import tempfile
import time
from pathlib import Path

from bench import write_results
from tests.support.harness import Deployment, wait_for

RESULTS = Path("bench/results")
ROLES = {"alice": "trainer", "bob": "trainer", "dave": "auxiliary"}


def trial(deployment: Deployment, index: int, settle: float) -> list[dict]:
    names = {f"{name}{index}": role for name, role in ROLES.items()}
    first, *others = names
    deployment.start_worker(first)
    if index == 0:
        deployment.wait_for_founder(first)
    for name in others:
        deployment.start_worker(name, *(["--aux"] if names[name] == "auxiliary" else []))
    wait_for(lambda: all("epoch" in (deployment.logs / f"{name}.log").read_text() for name in names), 180,
             "all three to train")
    time.sleep(settle)
    pressed = time.monotonic()
    for name in names:
        deployment.processes[name].send_signal(signal.SIGINT)
    exited: dict[str, float] = {}
    while len(exited) < len(names) and time.monotonic() - pressed < 120:
        for name in names:
            if name not in exited and deployment.processes[name].poll() is not None:
                exited[name] = time.monotonic() - pressed
        time.sleep(0.02)
    return [dict(trial=index, worker=name, role=role, exit_code=deployment.processes[name].wait(10),
                 seconds=round(exited[name], 2)) for name, role in names.items()]


def markdown(rows: list[dict]) -> str:
    lines = ["# Ctrl-C on a swarm's workers", "",
             "Written by `python -m bench.leave`: two trainers and an auxiliary peer (tiny-lm, loopback, this "
             "machine's cores) Ctrl-C'd together, at a different moment of the epoch in each trial; seconds until "
             "each process exited. Method: docs/benchmarks.md#leaving.", "",
             "| trial | trainers, s | auxiliary, s | exit codes |", "| ---: | ---: | ---: | --- |"]
    for index in sorted({row["trial"] for row in rows}):
        mine = [row for row in rows if row["trial"] == index]
        trainers = max(row["seconds"] for row in mine if row["role"] == "trainer")
        aux = max(row["seconds"] for row in mine if row["role"] == "auxiliary")
        lines.append(f"| {index} | {trainers:.2f} | {aux:.2f} | {', '.join(str(row['exit_code']) for row in mine)} |")
    worst = max(row["seconds"] for row in rows)
    lines += ["", f"Slowest exit: {worst:.2f} s over {len(rows)} workers."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.leave")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS / "leave.json")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dedloc-bench-leave-"))
    deployment = Deployment(work, work / "logs", slug="leave")
    rows = []
    try:
        deployment.create_run()
        deployment.start_servers()
        for index in range(args.trials):
            rows += trial(deployment, index, settle=8 + 1.1 * index)  # epochs take ~3-4 s here: phases move
            print(rows[-3:], flush=True)
    finally:
        deployment.close()
        shutil.rmtree(work, ignore_errors=True)
    write_results(args.out, rows, markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
