"""A fresh demo, watched as a newcomer would watch `make demo` (docs/benchmarks.md#demo).

    python -m bench.demo [--minutes 5] [--out bench/results/demo.json]

Runs ``dedloc demo`` (what `make demo` runs once set up) in a new data folder on a free port for ``--minutes``,
then presses Ctrl-C and times until every process it started has ended. Reports, from the demo's database and its
terminal: the claims and samples credited and held (with each distinct reason held), the claims that went into no
averaging round, the terminal's tracebacks, and the stop time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench import write_results
from bench.training import free_port

RESULTS = Path("bench/results")


TAG = "DEDLOC_BENCH_DEMO"  # in the demo's environment, so every process it starts carries it


def stop_and_time(demo: subprocess.Popen, tag: str, limit: float = 60.0) -> float:
    """Ctrl-C (SIGINT to the demo, as a terminal sends it); seconds until no process it started is left."""
    from app.core.processes import tagged_processes

    pressed = time.monotonic()
    demo.send_signal(signal.SIGINT)
    while (demo.poll() is None or tagged_processes(TAG, tag)) and time.monotonic() - pressed < limit:
        time.sleep(0.05)
    seconds = time.monotonic() - pressed
    for pid in tagged_processes(TAG, tag):  # past the limit: leave nothing behind, and the figure says so
        os.kill(pid, signal.SIGKILL)
    demo.wait()
    return seconds


def claims_of(database_url: str) -> dict:
    from sqlalchemy import select

    from app.core.database import make_engine, make_sessionmaker
    from app.models import Contribution

    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            rows = session.execute(select(Contribution.credited, Contribution.held, Contribution.reason,
                                          Contribution.group_id, Contribution.epoch)
                                   .where(Contribution.samples > 0)).all()
    finally:
        engine.dispose()
    held = [row for row in rows if row.held > 0]
    # A round can fail only in an epoch two or more peers trained in: the founder's epochs alone have none to fail.
    claimants, without = Counter(row.epoch for row in rows), {row.epoch for row in rows if not row.group_id}
    shared = [epoch for epoch, count in claimants.items() if count >= 2]
    return dict(claims=len(rows), samples_credited=sum(row.credited for row in rows),
                samples_held=sum(row.held for row in held), claims_held=len(held),
                claims_without_round=sum(1 for row in rows if not row.group_id),
                shared_epochs=len(shared), shared_epochs_without_round=sum(1 for e in shared if e in without),
                held_reasons=dict(Counter(row.reason or "" for row in held)))


def watch_demo(minutes: float) -> dict:
    work = Path(tempfile.mkdtemp(prefix="dedloc-bench-demo-"))
    tag = work.name
    env = {**os.environ, TAG: tag, "DEDLOC_DATA_DIR": str(work / "var"), "DEDLOC_PORT": str(free_port()),
           "DATABASE_URL": ""}
    terminal = work / "terminal.log"
    with terminal.open("w") as out:
        demo = subprocess.Popen([sys.executable, "-m", "app.cli", "demo"], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            time.sleep(minutes * 60)
            if demo.poll() is not None:
                raise RuntimeError(f"the demo exited early (code {demo.returncode}); see {terminal}")
            found = claims_of(f"sqlite:///{work / 'var' / 'dedloc.sqlite3'}")
        finally:
            stop_seconds = stop_and_time(demo, tag)
    text = terminal.read_text()
    shutil.rmtree(work, ignore_errors=True)  # kept only when the demo exited early (the error names its log)
    return dict(minutes=minutes, **found, tracebacks=text.count("Traceback"), stop_seconds=round(stop_seconds, 2))


def markdown(row: dict) -> str:
    share = row["claims_without_round"] / row["claims"] if row["claims"] else 0.0
    failed = row["shared_epochs_without_round"] / row["shared_epochs"] if row["shared_epochs"] else 0.0
    lines = ["# A fresh demo, watched", "",
             f"Written by `python -m bench.demo`: `dedloc demo` (two ALBERT workers, the portal and the coordinator "
             f"on this machine's cores) for {row['minutes']:g} minutes, then Ctrl-C. Method: "
             "docs/benchmarks.md#demo.", "",
             "`failed rounds`: epochs two or more workers trained in (a round could form) in which some claim",
             "went into no averaging round; `without a round` also counts the founder's epochs alone.", "",
             "| claims | without a round | epochs shared | failed rounds | samples credited | samples held | "
             "claims held | tracebacks | Ctrl-C to nothing running |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
             f"| {row['claims']} | {row['claims_without_round']} ({share:.1%}) | {row['shared_epochs']} | "
             f"{row['shared_epochs_without_round']} ({failed:.1%}) | {row['samples_credited']:,} | "
             f"{row['samples_held']:,} | {row['claims_held']} | {row['tracebacks']} | {row['stop_seconds']:.1f} s |",
             "", "Reasons the held claims were given:", ""]
    lines += [f"- {count} x \"{reason}\"" for reason, count in row["held_reasons"].items()] or ["- none held"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.demo")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "demo.json")
    args = parser.parse_args(argv)
    row = watch_demo(args.minutes)
    print(markdown(row), flush=True)
    write_results(args.out, row, markdown(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
