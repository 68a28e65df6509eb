"""`make bench`: every benchmark of the project, each writing its results under bench/results/.

    python -m bench [--rounds N]

1. The averaging simulation (``bench.simulate_averaging``, deterministic): ``averaging_sim.json``; and a
   1,000-peer swarm averaging in groups (``bench.simulate_groups``): ``averaging_groups.json`` and ``.md``.
2. The averaging emulation on network namespaces (``bench.emulate_averaging``, needs root; a "skipped" row
   elsewhere): ``averaging_emu.json``.
3. Both side by side: ``averaging.json`` (a list of rows with ``mode`` "sim" or "emu") and ``averaging.md``.
4. Training throughput, a swarm against solo processes (``bench.training``): ``training.json`` and ``training.md``.
4b. The cost of robust aggregation, CenteredClip against the plain mean on the emulated profiles (``bench.robust_cost``,
   needs root; a "skipped" row elsewhere): ``robust_cost.json`` and ``robust_cost.md``.
4c. Large-batch against local-updates (DiLoCo) on emulated slow links: efficiency, bytes per sample, held-out loss
   (``bench.local_updates``, needs root; a "skipped" row elsewhere): ``local_updates.json`` and ``local_updates.md``.
4d. The GPU path's CPU half (``bench.gpu --device cpu``): the worker's tasks, an adapter and a two-worker swarm on
   the CPU, and the memory the worker predicts against the peak: ``gpu.json`` and ``gpu.md`` (their CUDA section, from
   ``make bench-gpu``, is kept).
5. Load on a deployment: PostgreSQL, two web processes, thousands of viewers (``bench.load``): ``load.json``,
``load.md``. 6. The paper's equivalence claim, a two-peer swarm against one process (``bench.equivalence``):
``equivalence.json``
   and ``equivalence.md``.
7. What spot checks cost a worker and the swarm, on the demo's model (``bench.spot_checks``): ``spot_checks.json``
   and ``spot_checks.md``.
8. A fresh demo watched for five minutes, then Ctrl-C (``bench.demo``): held samples and their reasons, claims
   without a round, tracebacks, the stop time: ``demo.json`` and ``demo.md``.
9. Ctrl-C on two trainers and an auxiliary peer at once, at moments across the epoch (``bench.leave``): seconds
   until each exits: ``leave.json`` and ``leave.md``.
10. Thirty minutes of volunteers coming and going, with a checker of the history afterwards (``bench.soak``): a row
   per run appended to ``soak.json`` and ``soak.md``.

How each bench measures, and what the figures mean: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from bench import (
    demo,
    emulate_averaging,
    equivalence,
    gpu,
    leave,
    load,
    local_updates,
    robust_cost,
    simulate_averaging,
    simulate_groups,
    soak,
    spot_checks,
    training,
)
from bench.emulate_averaging import ROUNDS

RESULTS = Path("bench/results")
COLUMNS = ("ring", "tcp", "equal", "hivemind", "planner", "lower_bound")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description="every benchmark of the project")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"emulated rounds per mode and profile (default {ROUNDS})")
    args = parser.parse_args(argv)

    sim_path, emu_path = RESULTS / "averaging_sim.json", RESULTS / "averaging_emu.json"
    code = simulate_averaging.main(["--scale", "1000", "--out", str(sim_path)])
    code = code or simulate_groups.main(["--out", str(RESULTS / "averaging_groups.json")])
    code = code or emulate_averaging.main(["--rounds", str(args.rounds), "--out", str(emu_path)])
    if code:
        return code
    rows = json.loads(sim_path.read_text()) + json.loads(emu_path.read_text())
    (RESULTS / "averaging.json").write_text(json.dumps(rows, indent=2) + "\n")
    (RESULTS / "averaging.md").write_text(markdown_table(rows))
    print(f"wrote {RESULTS / 'averaging.json'} and {RESULTS / 'averaging.md'}")
    code = training.main(["--out", str(RESULTS / "training.json")])
    code = code or robust_cost.main(["--out", str(RESULTS / "robust_cost.json")])
    code = code or local_updates.main(["--out", str(RESULTS / "local_updates.json")])
    code = code or gpu.main(["--device", "cpu", "--out", str(RESULTS / "gpu.json")])
    code = code or load.main(["--out", str(RESULTS / "load.json")])
    code = code or equivalence.main(["--out", str(RESULTS / "equivalence.json")])
    code = code or spot_checks.main(["--out", str(RESULTS / "spot_checks.json")])
    code = code or demo.main(["--out", str(RESULTS / "demo.json")])
    code = code or leave.main(["--out", str(RESULTS / "leave.json")])
    return code or soak.main(["--out", str(RESULTS / "soak.json")])


def markdown_table(rows: Sequence[dict]) -> str:
    """Seconds per averaging round, every strategy side by side, one line per profile and mode."""
    lines = [
        "# Seconds per averaging round",
        "",
        "Written by `make bench` (`python -m bench`). `sim`: the round model of `app.planner` on 16-20 peers and a",
        "100 MB vector. `emu`: real hivemind rounds between four network namespaces on `tc tbf` links, a 10 MB",
        "vector, the median of the rounds that passed the check against the true mean (`ring` is gloo's",
        "all-reduce there; `tcp`, the planner's round as plain TCP traffic between the same peers, the most its",
        "split can get from these links: `bench/raw_tcp.py`). `lower bound`: `app.planner.lower_bound_seconds` for",
        "the nominal link rates, without hold-back: the planner's groups return results to zero-share and",
        "client-mode peers while they upload (plain hivemind, in the `equal` and `hivemind` columns, holds them back",
        "until the upload ends), and send each aggregator at most 4 parts ahead of its results. Why, and what limits",
        "4x100 here: docs/benchmarks.md#averaging-emulation-findings.",
        "",
        "| profile | mode | ring | tcp | equal | hivemind | planner | lower bound | ring / planner | planner / bound "
        "| tcp / bound | planner / tcp | planner / equal | notes |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        cells = [_seconds(row.get(key)) for key in COLUMNS]
        ratios = [_ratio(row.get(a), row.get(b)) for a, b in (("ring", "planner"), ("planner", "lower_bound"),
                                                               ("tcp", "lower_bound"), ("planner", "tcp"),
                                                               ("planner", "equal"))]
        lines.append(f"| {row['profile']} | {row['mode']} | " + " | ".join(cells + ratios) + f" | {_notes(row)} |")
    return "\n".join(lines) + "\n"


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(numerator, denominator) -> str:
    return "-" if not numerator or not denominator else f"{numerator / denominator:.2f}x"


def _notes(row: dict) -> str:
    notes = [row[key] for key in ("skipped", "note", "ring_note") if row.get(key)]
    if row.get("planner_live") and row["planner_live"] != row.get("planner"):
        notes.append(f"live plan (each sender aggregates whole parts, for attestation): {row['planner_live']:.3f} s")
    if row["mode"] == "emu" and "failed_rounds" in row:
        failed = {mode: sum(kinds.values()) for mode, kinds in row["failed_rounds"].items()}
        notes.append(f"{row['rounds']} rounds; tbf queue {row['queue_ms']:g} ms; {row['part_bytes'] // 1024} KiB parts")
        if any(failed.values()):
            notes.append("failed attempts (retried): " + ", ".join(f"{m} {n}" for m, n in failed.items() if n))
    return "; ".join(notes).replace("|", "/")


if __name__ == "__main__":
    sys.exit(main())
