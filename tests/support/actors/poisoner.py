"""One peer of the poisoning swarm (tests/test_robust_aggregation.py): it trains a linear regression with real
hivemind averaging through dedloc's ``PlannedAverager``, and runs the schedule's scenarios in order.

    python tests/support/actors/poisoner.py SCHEDULE.json INDEX OUT.json [INITIAL_PEER ...]

Peer 0 starts the DHT and writes its address to ``OUT.json.addr``. Every scenario starts, after a barrier in the
DHT, from the same parameters (zeros); the peer whose index is the schedule's ``attacker`` sends what the scenario's
``attack`` says: ``x1000`` (gradients x1000), ``flip`` (sign-flipped), ``nan`` (NaN and Inf in every part),
``weight`` (sign-flipped, with 100x the samples as its weight). ``OUT.json`` holds, per scenario, the final loss on
held-out data and what this peer attested as an aggregator in each round; it is rewritten after every scenario.
Each round every peer "computes" for ``compute_seconds`` (a sleep): its honest rate is ``batch / compute_seconds``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import hivemind
import torch
from hivemind.utils import get_dht_time

from dedloc_worker.averaging import PlannedAverager
from dedloc_worker.robust import RobustRule

PEERS = 4


def problem(schedule: dict):
    """The shared truth and held-out data (same in every process), and this run's batches."""
    generator = torch.Generator().manual_seed(schedule["seed"])
    truth = torch.randn(schedule["dim"], generator=generator)
    held_out = torch.randn(512, schedule["dim"], generator=generator)
    return truth, held_out, held_out @ truth


def batch(schedule: dict, truth: torch.Tensor, peer: int, round_index: int):
    generator = torch.Generator().manual_seed(schedule["seed"] * 100_003 + 1000 * peer + round_index)
    features = torch.randn(schedule["batch"], schedule["dim"], generator=generator)
    return features, features @ truth + 0.5 * torch.randn(schedule["batch"], generator=generator)


def gradient(weights: torch.Tensor, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return 2 * features.T @ (features @ weights - targets) / len(targets)


def poison(attack: str | None, grad: torch.Tensor, weight: float) -> tuple[torch.Tensor, float]:
    if attack == "x1000":
        return grad * 1000, weight
    if attack == "flip":
        return -grad, weight
    if attack == "nan":
        grad = grad.clone()
        grad[0::4], grad[1::8] = float("nan"), float("inf")  # every 4-value part holds a NaN
        return grad, weight
    if attack == "weight":
        return -grad, 100 * weight
    return grad, weight


def barrier(dht: hivemind.DHT, name: str, index: int, timeout: float = 60) -> None:
    key, deadline = f"poison_barrier_{name}", time.monotonic() + timeout
    dht.store(key, subkey=index, value=True, expiration_time=get_dht_time() + 600)
    while time.monotonic() < deadline:
        found = dht.get(key, latest=True)
        if found is not None and len(found.value) >= PEERS:
            return
        time.sleep(0.05)
    raise SystemExit(f"barrier {name}: not every peer arrived in {timeout:.0f} s")


def run_scenario(schedule, scenario, averager, index, truth, held_out, targets) -> dict:
    weights = torch.zeros(schedule["dim"])
    attested, complete = [], 0
    attacking = index == schedule["attacker"] and scenario.get("attack")
    for round_index in range(schedule["epochs"]):
        time.sleep(schedule["compute_seconds"])
        grad = gradient(weights, *batch(schedule, truth, index, round_index))
        sent, weight = poison(scenario.get("attack") if attacking else None, grad, float(schedule["batch"]))
        with averager.get_tensors() as (tensor,):
            tensor.copy_(sent)
        try:
            formed = averager.step(weight=weight, timeout=schedule["round_timeout"]) is not None
        except Exception:  # a failed round: the peer keeps its own gradient, as hivemind's optimizer does
            formed = False
        outcome = averager.last_round(timeout=10)
        complete += bool(formed and outcome is not None and outcome.complete)
        attested.append(outcome.attested if formed and outcome is not None else {})
        with averager.get_tensors() as (tensor,):
            averaged = tensor.clone() if formed else grad
        if not attacking or bool(torch.isfinite(averaged).all()):  # the attacker follows the swarm's model
            weights = weights - schedule["lr"] * averaged
    loss = float(((held_out @ weights - targets) ** 2).mean())
    return {"name": scenario["name"], "loss": loss if math.isfinite(loss) else None, "complete": complete,
            "attested": attested}


def main(schedule_path: str, index: str, out_path: str, *initial_peers: str) -> None:
    schedule, index, out = json.loads(Path(schedule_path).read_text()), int(index), Path(out_path)
    truth, held_out, targets = problem(schedule)
    dht = hivemind.DHT(initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    if index == 0:
        Path(f"{out}.addr").write_text(json.dumps([str(addr) for addr in dht.get_visible_maddrs()]))
    rule = RobustRule(tau=schedule["tau"], iterations=schedule["iterations"], ceiling=schedule["ceiling"],
                      grace=schedule["grace"])
    # 4-value parts: each peer aggregates one. allreduce_timeout: under load a peer can give up matchmaking just as
    # the leader counts it in, and the others would wait for its parts forever.
    common = dict(start=True, target_group_size=PEERS, min_group_size=PEERS, min_matchmaking_time=2.0,
                  request_timeout=1.0, part_size_bytes=16, allreduce_timeout=10.0)
    averagers = {
        "centered_clip": PlannedAverager([torch.zeros(schedule["dim"])], dht, prefix="poison_robust", robust=rule,
                                         **common),
        "mean": PlannedAverager([torch.zeros(schedule["dim"])], dht, prefix="poison_mean", **common),
    }
    results = {"peer_id": str(dht.peer_id), "scenarios": []}
    try:
        for scenario in schedule["scenarios"]:
            barrier(dht, scenario["name"], index)
            averager = averagers[scenario["aggregation"]]
            results["scenarios"].append(run_scenario(schedule, scenario, averager, index, truth, held_out, targets))
            out.write_text(json.dumps(results))
    finally:
        for averager in averagers.values():
            averager.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
