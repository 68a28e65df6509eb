"""The cost of robust aggregation: seconds per averaging round with CenteredClip against hivemind's plain mean.

    python -m bench.robust_cost [--rounds N] [--profile NAME ...] [--out bench/results/robust_cost.json]

The same four peers and emulated links as ``bench.emulate_averaging`` (network namespaces, ``tc tbf``, a 10 MB
vector, needs root); each peer runs two ``PlannedAverager``s, one with the plain mean and one with a
``RobustRule`` (CenteredClip with the run defaults' iterations), and the two modes alternate round by round. The
radius is so large that nothing is clipped, so every round is still checked against the true mean: CenteredClip
runs all its iterations whatever the radius, so this is its full cost. Without root it writes a "skipped" row.
Method and figures: docs/benchmarks.md#robust-aggregation; results: bench/results/robust_cost.md.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from dedloc_common.contract import OptimizerOptions

from bench import write_results
from bench.emulate_averaging import (
    PROFILES,
    VECTOR_BYTES,
    Profile,
    Settings,
    Star,
    _exit_on_signal,
    namespaces_unavailable,
    run_round,
    signals_ignored,
    start_peers,
)

DEFAULT_OUT = Path("bench/results/robust_cost.json")
ROUNDS = 7
MODES = ("mean", "centered_clip")
# Nothing clipped (so the mean is checkable) and the run's default iterations (each runs whatever the radius).
RULE = {"tau": 1e12, "iterations": OptimizerOptions().clip_iterations}


def run_profile(name: str, profile: Profile, rounds: int, logs: Path) -> dict:
    star, peers = Star(profile.links, Settings().queue_ms), []
    try:
        peers, _ = start_peers(star, profile, VECTOR_BYTES // 4, Settings().part_bytes, logs, name, robust=RULE)
        seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
        failed = {mode: 0 for mode in MODES}
        seed = 1
        for r in range(rounds):
            for mode in MODES[r % 2:] + MODES[:r % 2]:  # alternate which mode goes first
                seed += len(peers)
                outcome, replies, why = run_round(peers, [dict(cmd="average", robust=mode != "mean")] * len(peers),
                                                  seed)
                if outcome != "ok":
                    failed[mode] += 1
                    print(f"  round {r + 1} {mode}: failed ({outcome}): {why}", flush=True)
                    continue
                seconds[mode].append(max(reply["ended"] for reply in replies) - min(r["began"] for r in replies))
            print(f"  round {r + 1}/{rounds}: " + ", ".join(
                f"{mode} {seconds[mode][-1]:.2f} s" for mode in MODES if seconds[mode]), flush=True)
        median = {mode: round(statistics.median(times), 4) if times else None for mode, times in seconds.items()}
        ratio = (round(median["centered_clip"] / median["mean"], 3)
                 if median["mean"] and median["centered_clip"] else None)
        return {"profile": name, **median,
                "clip_over_mean": ratio, "rounds": {mode: len(times) for mode, times in seconds.items()},
                "failed_rounds": failed, "vector_bytes": VECTOR_BYTES, "iterations": RULE["iterations"],
                "note": profile.note}
    finally:
        with signals_ignored():
            for peer in peers:
                peer.stop()
            star.close()


def markdown(rows: Sequence[dict]) -> str:
    lines = [
        "# Seconds per averaging round: CenteredClip against the plain mean",
        "",
        "Written by `make bench` (`python -m bench.robust_cost`). Four hivemind peers average a 10 MB fp32 vector",
        "with `PlannedAverager`, once with hivemind's weighted mean and once with robust aggregation (every",
        f"sender's copy of a part kept, then CenteredClip, {RULE['iterations']} iterations), modes alternating",
        "round by round; the median of the rounds checked against the true mean. Method: docs/benchmarks.md.",
        "",
        "| profile | mean | centered clip | clip / mean | rounds (mean / clip) | failed (mean / clip) |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for row in rows:
        if row.get("skipped"):
            lines.append(f"| {row['profile']} | skipped: {row['skipped']} | - | - | - | - |")
            continue
        cells = ["-" if row.get(key) is None else f"{row[key]:.3f}" for key in ("mean", "centered_clip",
                                                                               "clip_over_mean")]
        counts = [" / ".join(str(row[key][mode]) for mode in MODES) for key in ("rounds", "failed_rounds")]
        lines.append(f"| {row['profile']} | " + " | ".join(cells + counts) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.robust_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT}; "
                        "the table goes next to it as .md)")
    parser.add_argument("--profile", action="append", choices=sorted(PROFILES), help="profile to run (repeatable)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds per mode and profile (default {ROUNDS})")
    args = parser.parse_args(argv)
    reason = namespaces_unavailable()
    logs = Path(tempfile.mkdtemp(prefix="dedloc-robust-logs-"))
    rows = []
    if reason:
        print(f"robust aggregation cost skipped: {reason}")
        rows.append({"profile": "emulation", "skipped": reason})
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    for name in [] if reason else args.profile or PROFILES:
        print(f"profile {name}: {args.rounds} round(s) of {', '.join(MODES)}", flush=True)
        started = time.monotonic()
        rows.append(run_profile(name, PROFILES[name], args.rounds, logs))
        rows[-1]["wall_seconds"] = round(time.monotonic() - started, 1)
    write_results(args.out, rows, markdown(rows))
    print(markdown(rows))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}; peer logs in {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
