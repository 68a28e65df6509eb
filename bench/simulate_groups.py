"""Simulated 1,000-peer swarm averaging in groups: round and step time, the planner's time, a failure's reach.

    python -m bench.simulate_groups [--peers 1000] [--out bench/results/averaging_groups.json]

A seeded swarm (``swarm``): a tenth servers at 1 Gbit/s, the rest home links of 100 Mbit/s down and 20 up (a
fifth of those behind NAT, in client mode), a fifth of all peers training on their CPU; V = 10^8 bytes as in
``bench.simulate_averaging``. For each group size (None: one group of every peer) the planner's ``plan_step``
gives the groups, shares, round and step times (round model of ``app.planner``, no hold-back: planned groups
stream), and the bench adds:

- ``planning_seconds``: median wall time of ``plan_step`` over 5 runs (measured: the only non-deterministic
  figure, so it is rounded to the millisecond);
- ``random_groups_round_seconds``: the median round time over 20 seeded draws of groups formed as hivemind's
  matchmaking forms them (by arrival: any peers, up to the group size), each peer keeping its planned share,
  normalised within the group it lands in, as ``planned_fractions`` does;
- the share of the global batch lost when one peer dies mid-round: its group's round fails, and that group's
  samples (each peer contributes in proportion to its throughput) are averaged by nobody. ``expected`` is over a
  peer chosen uniformly at random, ``worst`` the group with the most compute.

See docs/benchmarks.md#groups-at-scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from app.coordinator.planning import CPU_REDUCE_BPS, attestation_floor
from app.planner import PeerProfile, Plan, StepOptions, plan_step, round_seconds
from bench import write_results

VECTOR_BYTES = 10**8
TARGET_BATCH = 2**20  # samples per step: tens of seconds of this swarm's compute, as the round
GROUP_SIZES = (None, 8)
DEFAULT_OUT = Path("bench/results/averaging_groups.json")
MBIT = 1e6 / 8


def swarm(n_peers: int, seed: int = 0) -> list[PeerProfile]:
    """The seeded swarm of the module doc."""
    rng = np.random.default_rng(seed)
    peers = []
    for i in range(n_peers):
        server = rng.random() < 0.1
        cpu = rng.random() < 0.2
        up, down = (1000, 1000) if server else (20, 100)
        extra = dict(reduce_bps=CPU_REDUCE_BPS, reduce_costs_training=True) if cpu else {}
        peers.append(PeerProfile(f"p{i:04d}", 3.0 if cpu else 30.0, up * MBIT, down * MBIT,
                                 client_mode=not server and rng.random() < 0.2, **extra))
    return peers


def random_groups(peers: Sequence[PeerProfile], group_size: int, rng: np.random.Generator) -> list[list[PeerProfile]]:
    """Groups by arrival: a random order cut into groups of ``group_size``; client-mode peers cannot lead, so each
    group is opened by a peer that accepts connections (as hivemind's matchmaking requires)."""
    order = [peers[i] for i in rng.permutation(len(peers))]
    leaders = [p for p in order if p.can_aggregate]
    followers = [p for p in order if not p.can_aggregate]
    count = -(-len(peers) // group_size)
    groups = [[leader] for leader in leaders[:count]]
    rest = leaders[count:] + followers
    rng.shuffle(rest)
    for index, p in enumerate(rest):
        groups[index // (group_size - 1) % count].append(p)
    return groups


def random_groups_round(peers: Sequence[PeerProfile], plan: Plan, group_size: int, draws: int = 20) -> float:
    """Median round time over ``draws`` draws of groups by arrival, each peer keeping its planned share."""
    rng = np.random.default_rng(1)
    rounds = []
    for _ in range(draws):
        slowest = 0.0
        for group in random_groups(peers, group_size, rng):
            shares = {p.peer: plan.shares[p.peer] for p in group}
            total = sum(share for p, share in zip(group, shares.values()) if p.can_aggregate)
            shares = {k: v / total for k, v in shares.items()}
            slowest = max(slowest, round_seconds(group, shares, VECTOR_BYTES, hold_back=False))
        rounds.append(slowest)
    return statistics.median(rounds)


def lost_share(peers: Sequence[PeerProfile], plan: Plan) -> tuple[float, float]:
    """(expected, worst) share of the global batch whose round fails when one peer dies mid-round."""
    by_id = {p.peer: p for p in peers}
    groups = plan.groups or (tuple(by_id),)
    total = sum(p.samples_per_second for p in peers)
    compute = [sum(by_id[i].samples_per_second for i in g) / total for g in groups]
    expected = sum(len(g) / len(peers) * share for g, share in zip(groups, compute))
    return expected, max(compute)


def simulate(n_peers: int, group_size: int | None, overlap: bool = True) -> dict:
    peers = swarm(n_peers)
    options = StepOptions(TARGET_BATCH, overlap=overlap, group_size=group_size)

    def solve() -> Plan:
        return plan_step(peers, VECTOR_BYTES, options,
                         min_share=lambda group: attestation_floor(group, VECTOR_BYTES))

    timings = []
    for _ in range(5):
        start = time.perf_counter()
        plan = solve()
        timings.append(time.perf_counter() - start)
    expected, worst = lost_share(peers, plan)
    roles = {role: sum(1 for r in plan.roles.values() if r == role) for role in sorted(set(plan.roles.values()))}
    row = dict(profile=f"{n_peers} peers", peers=n_peers, group_size=group_size, groups=len(plan.groups) or 1,
               vector_bytes=VECTOR_BYTES, target_batch_size=TARGET_BATCH, overlap=overlap,
               round_seconds=round(plan.predicted_seconds, 3), lower_bound_seconds=round(plan.lower_bound_seconds, 3),
               accumulate_seconds=round(plan.accumulate_seconds, 3), step_seconds=round(plan.step_seconds, 3),
               planning_seconds=round(statistics.median(timings), 3),
               lost_share_expected=round(expected, 5), lost_share_worst=round(worst, 5), roles=roles)
    if group_size is not None:
        row["random_groups_round_seconds"] = round(random_groups_round(peers, plan, group_size), 3)
    return row


def markdown(rows: Sequence[dict]) -> str:
    lines = [
        "# Averaging in groups: a simulated swarm", "",
        "Written by `python -m bench.simulate_groups` (part of `make bench`): the planner's `plan_step` on a seeded",
        "swarm (a tenth 1 Gbit/s servers, the rest 100/20 Mbit/s home links, a fifth of those behind NAT, a fifth of",
        f"all peers on CPU), V = {VECTOR_BYTES / 1e6:.0f} MB, {TARGET_BATCH:,} samples per step, delayed parameter "
        "updates. Lost: the share of the",
        "global batch whose round fails when one peer dies mid-round (its group's samples). Planning: median wall "
        "time of 5 solves, this machine.",
        "Random groups: the round when groups form by arrival, as hivemind's matchmaking forms them, with the "
        "planned shares. Method: docs/benchmarks.md#groups-at-scale.", "",
        "| peers | group size | groups | round (s) | random groups (s) | bound (s) | step (s) | planning (s) "
        "| lost, expected | lost, worst | roles |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        random_round = r.get("random_groups_round_seconds")
        lines.append(
            f"| {r['peers']} | {r['group_size'] or 'all'} | {r['groups']} | {r['round_seconds']:.3f} | "
            f"{'-' if random_round is None else f'{random_round:.3f}'} | {r['lower_bound_seconds']:.3f} | "
            f"{r['step_seconds']:.3f} | {r['planning_seconds']:.3f} | {r['lost_share_expected']:.2%} | "
            f"{r['lost_share_worst']:.2%} | " + ", ".join(f"{k} {v}" for k, v in r["roles"].items()) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.simulate_groups", description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    rows = [simulate(args.peers, size) for size in GROUP_SIZES]
    for row in rows:
        print(json.dumps(row), flush=True)
    write_results(args.out, rows, markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
