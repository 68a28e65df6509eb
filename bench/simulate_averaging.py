"""Simulated seconds per averaging round: the planner against the strategies it can recover and the lower bound.

    python -m bench.simulate_averaging [--out bench/results/averaging_sim.json] [--profile NAME ...] [--scale N]

Every peer averages V = 10^8 bytes (100 MB, 25 million fp32 values; the paper's ALBERT-large is 18M parameters,
72 MB in fp32). Links are given in Mbit/s and converted to bytes per second. Times come from the round model of
``app.planner.lp`` (butterfly all-reduce as hivemind 1.1.12 runs it; hold-back of zero-share peers for the
plain-hivemind strategies, none for the planner, whose groups stream results to every peer), so the output is
deterministic: a simulation, not a measurement on emulated links. ``--scale N`` also times the
planner on N seeded random peers; that timing is printed only, never written, to keep the JSON deterministic.
See docs/benchmarks.md#averaging-simulation.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from app.coordinator.planning import attestation_floor
from app.planner import (
    PeerProfile,
    byteps_seconds,
    equal_split_seconds,
    hivemind_split_seconds,
    lower_bound_seconds,
    parameter_server_seconds,
    plan_averaging,
    ring_allreduce_seconds,
)

VECTOR_BYTES = 10**8
WORKER_SAMPLES_PER_SECOND = 100.0  # informational only: the round time does not depend on compute
DEFAULT_OUT = Path("bench/results/averaging_sim.json")
COLUMNS = ("ring", "parameter_server", "byteps", "equal", "hivemind", "planner", "lower_bound")
HEADERS = ("ring", "param.server", "byteps", "equal", "hivemind", "planner", "lower bound")


def _peer(name: str, up_mbit: float, down_mbit: float | None = None, **role: bool) -> PeerProfile:
    """A peer with links in Mbit/s (download defaults to upload), converted to bytes per second."""
    down_mbit = up_mbit if down_mbit is None else down_mbit
    samples = 0.0 if role.get("aux") else WORKER_SAMPLES_PER_SECOND
    return PeerProfile(name, samples, up_mbit * 1e6 / 8, down_mbit * 1e6 / 8, **role)


def homogeneous() -> list[PeerProfile]:
    """16 peers at 1 Gbit/s both ways: ring all-reduce is already optimal."""
    return [_peer(f"peer{i:02d}", 1000) for i in range(16)]


def mixed_links() -> list[PeerProfile]:
    """8 peers at 1 Gbit/s and 8 at 100 Mbit/s: servers and workstations."""
    return [_peer(f"fast{i}", 1000) for i in range(8)] + [_peer(f"slow{i}", 100) for i in range(8)]


def cpu_servers() -> list[PeerProfile]:
    """4 auxiliary CPU servers at 1 Gbit/s and 16 GPU workers at 200 Mbit/s down, 50 Mbit/s up."""
    servers = [_peer(f"cpu{i}", 1000, aux=True) for i in range(4)]
    return servers + [_peer(f"worker{i:02d}", 50, 200) for i in range(16)]


def half_nat() -> list[PeerProfile]:
    """16 peers, every other one behind NAT (client mode); in each half, 4 at 1 Gbit/s and 4 at 100 Mbit/s."""
    return [
        _peer(f"{'nat' if i % 2 else 'pub'}{i:02d}", 1000 if i < 8 else 100, client_mode=bool(i % 2))
        for i in range(16)
    ]


PROFILES: dict[str, Callable[[], list[PeerProfile]]] = {
    "homogeneous-16x1G": homogeneous,
    "mixed-8x1G-8x100M": mixed_links,
    "cpu-servers-4x1G+16x200M/50M": cpu_servers,
    "half-nat-16-mixed": half_nat,
}


def _rounded(seconds: float) -> float | None:
    """Seconds rounded to the microsecond; None where a strategy cannot run (JSON has no infinity)."""
    return round(seconds, 6) if math.isfinite(seconds) else None


def simulate_profile(name: str, peers: Sequence[PeerProfile], vector_bytes: float = VECTOR_BYTES) -> dict:
    """One result row: seconds per round for every strategy on these peers, plus their ratios."""
    # dedloc's averager streams results to zero-share peers in planned groups (no hold-back), so the planner and the
    # bound are without it; equal, hivemind, ring, parameter server and BytePS are plain hivemind's, with it
    plan = plan_averaging(peers, vector_bytes, hold_back=False)
    seconds = {
        "ring": ring_allreduce_seconds(peers, vector_bytes),
        "parameter_server": parameter_server_seconds(peers, vector_bytes),
        "byteps": byteps_seconds(peers, vector_bytes),
        "equal": equal_split_seconds(peers, vector_bytes),
        "hivemind": hivemind_split_seconds(peers, vector_bytes),
        "planner": plan.predicted_seconds,
        "lower_bound": plan.lower_bound_seconds,
        # the planner on hivemind's own runner, which holds back zero-share peers (client-mode ones pay for it)
        "planner_hold_back": plan_averaging(peers, vector_bytes).predicted_seconds,
        "lower_bound_hold_back": lower_bound_seconds(peers, vector_bytes),
        # the coordinator's live plan: every sender gets whole parts to aggregate, so that it can attest the others
        "planner_live": plan_averaging(peers, vector_bytes, hold_back=False,
                                       min_share=attestation_floor(list(peers), vector_bytes)).predicted_seconds,
    }
    row: dict = {"profile": name, "mode": "sim", "peers": len(peers), "vector_bytes": int(vector_bytes)}
    row.update({key: _rounded(value) for key, value in seconds.items()})
    row["ring_over_planner"] = _rounded(seconds["ring"] / seconds["planner"])
    row["planner_over_lower_bound"] = _rounded(seconds["planner"] / seconds["lower_bound"])
    return row


def format_table(rows: Sequence[dict]) -> str:
    """The rows as a fixed-width text table, seconds per round."""
    headers = ("profile",) + HEADERS + ("ring/planner", "planner/bound")
    keys = ("profile",) + COLUMNS + ("ring_over_planner", "planner_over_lower_bound")
    width = max(len(row["profile"]) for row in rows) + 2
    lines = [headers[0].ljust(width) + "".join(h.rjust(14) for h in headers[1:])]
    for row in rows:
        cells = ["-" if row[key] is None else f"{row[key]:.3f}" for key in keys[1:]]
        lines.append(row["profile"].ljust(width) + "".join(cell.rjust(14) for cell in cells))
    return "\n".join(lines)


def time_planning(n_peers: int, repeats: int = 5, seed: int = 0) -> float:
    """Median seconds to plan ``n_peers`` seeded random peers (10-1000 Mbit/s, 20% client mode, 5% aux)."""
    rng = np.random.default_rng(seed)
    links = rng.uniform(10, 1000, size=(n_peers, 2))
    peers = [
        _peer(f"p{i}", up, down, client_mode=bool(rng.random() < 0.2), aux=bool(rng.random() < 0.05))
        for i, (up, down) in enumerate(links.tolist())
    ]
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan_averaging(peers, VECTOR_BYTES)
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.simulate_averaging", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results file (default {DEFAULT_OUT})")
    parser.add_argument("--profile", action="append", choices=sorted(PROFILES), help="profile to run (repeatable)")
    parser.add_argument("--scale", type=int, metavar="N", help="also time planning for N random peers")
    args = parser.parse_args(argv)

    names = args.profile or list(PROFILES)
    rows = [simulate_profile(name, PROFILES[name]()) for name in names]
    print(f"seconds per averaging round, V = {VECTOR_BYTES} bytes (simulated)")
    print(format_table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.scale:
        print(f"planned {args.scale} peers in {time_planning(args.scale) * 1e3:.1f} ms (median of 5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
