"""One peer of the poisoning swarm (tests/test_robust_aggregation.py): it trains a linear regression with the
worker's own collaborative optimizer (``dedloc_worker.training.options.create_optimizer``: hivemind's Optimizer with
dedloc's gradient and state averagers, the run's default aggregation, tau and iterations), and runs the schedule's
scenarios.

    python tests/support/actors/poisoner.py SCHEDULE.json INDEX OUT.json [INITIAL_PEER ...]

Peer 0 starts the DHT and writes its address to ``OUT.json.addr``. Each peer holds two optimizers, one per
aggregation (``averaging.centered_clip``, ``mean``), on runs of their own; a scenario uses one, and the schedule's slots
run a scenario on each at once (in two threads). Every scenario starts, after a barrier in the DHT, from the same
parameters (zeros) and a fresh Adam, and runs until that optimizer's epoch reaches the scenario's ``until``. The
peer whose index is the schedule's ``attacker`` does what ``attack`` says:

- ``x1000``: its gradients x1000 in the scenario's first epoch (Adam normalizes a step's size: a steady x1000
  sender steers only the direction, one x1000 round inflates Adam's second moment and stalls its steps);
- ``flip``: its gradients times -4 (sign-flipped, outweighing the three honest ones in a plain mean);
- ``nan``: NaN and Inf in every gradient part; ``weight``: sign-flipped, with 100x its samples as its weight, from
  the scenario's second epoch;
- ``state-x1000``, ``state-nan``: its parameters x1000, or NaN, in the state rounds (every ``average_state_every``
  epochs; the schedule places a state round in these scenarios), and honest gradients.

``OUT.json`` holds, per scenario, the final loss on held-out data, the epochs it ran and what this peer attested as
an aggregator in each round (under ``averaging.centered_clip``); it is rewritten after every slot. Each mini-step
"computes" for ``compute_seconds`` (a sleep): a peer's honest rate is at most ``batch / compute_seconds``.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import threading
import time
from pathlib import Path

import hivemind
import torch
from dedloc_common.contract import LOOPBACK_OPTIMIZER, OptimizerOptions, RunConfig
from dedloc_worker.credit.receipts import ReceiptLog
from dedloc_worker.training import options as swarm
from hivemind.utils import get_dht_time

PEERS = 4


def problem(schedule: dict):
    """The shared truth and held-out data (same in every process)."""
    generator = torch.Generator().manual_seed(schedule["seed"])
    truth = torch.randn(schedule["dim"], generator=generator)
    held_out = torch.randn(512, schedule["dim"], generator=generator)
    return truth, held_out, held_out @ truth


def batch(schedule: dict, truth: torch.Tensor, peer: int, step: int):
    generator = torch.Generator().manual_seed(schedule["seed"] * 100_003 + 100_000 * peer + step)
    features = torch.randn(schedule["batch"], schedule["dim"], generator=generator)
    return features, features @ truth + 0.5 * torch.randn(schedule["batch"], generator=generator)


def gradient(weights: torch.Tensor, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return 2 * features.T @ (features @ weights - targets) / len(targets)


def poison(attack, grad: torch.Tensor, first_epoch: bool) -> torch.Tensor:
    if attack == "x1000" and first_epoch:
        return grad * 1000
    if attack == "flip":
        return -4 * grad
    if attack in ("nan", "weight"):
        grad = -grad if attack == "weight" else grad.clone()
        if attack == "nan":
            grad[0::4], grad[1::8] = float("nan"), float("inf")  # every 4-value part holds a NaN
        return grad
    return grad


def patch_attacker(optimizer) -> None:
    """Make this peer's averagers of ``optimizer`` send what ``optimizer.attack`` says: 100x its samples as its
    gradient round's weight, or poisoned parameters in its state rounds. It aggregates nothing (it announces no
    bandwidth, as a client-mode peer): this swarm tests what honest aggregators make of a poisoning sender, and
    hivemind gives a 16-value vector to one aggregator, which could otherwise be the attacker running honest code."""
    optimizer.attack = None
    optimizer.grad_averager.bandwidth = optimizer.state_averager.bandwidth = 0.0
    grad_step = optimizer.grad_averager.step

    def inflated_step(weight=None, **kwargs):
        if optimizer.attack == "weight":
            weight = optimizer.grad_averager.local_samples_accumulated * 100
        return grad_step(weight=weight, **kwargs)

    optimizer.grad_averager.step = inflated_step
    averager = optimizer.state_averager
    # hivemind averages the optimizer's own parameters (offloaded, reused as the averaged tensors) right after it
    # times the wait before the round: the state round then carries poisoned parameters, and the result replaces them
    timing = averager.delay_before_averaging
    update = timing.update

    def poisoning_update(*args, **kwargs):
        if optimizer.attack in ("state-x1000", "state-nan"):
            with torch.no_grad(), averager.get_tensors() as tensors:
                for tensor in tensors:
                    tensor.mul_(1000) if optimizer.attack == "state-x1000" else tensor.fill_(float("nan"))
        return update(*args, **kwargs)

    timing.update = poisoning_update


def barrier(dht: hivemind.DHT, name: str, index: int, timeout: float = 90) -> None:
    key, deadline = f"poison_barrier_{name}", time.monotonic() + timeout
    dht.store(key, subkey=index, value=True, expiration_time=get_dht_time() + 600)
    while time.monotonic() < deadline:
        found = dht.get(key, latest=True)
        if found is not None and len(found.value) >= PEERS:
            return
        time.sleep(0.05)
    raise SystemExit(f"barrier {name}: not every peer arrived in {timeout:.0f} s")


def reset(optimizer, initial: dict) -> None:
    """Zero parameters and a fresh optimizer, at the optimizer's epoch; no gradients left from the last scenario."""
    optimizer.state_averager.step(wait_for_delayed_updates=True)
    params = [p for group in optimizer.state_averager.optimizer.param_groups for p in group["params"]]
    swarm.restore(optimizer, {"parameters": [torch.zeros_like(p) for p in params],
                              "optimizer": copy.deepcopy(initial), "epoch": optimizer.local_epoch})
    optimizer.grad_averager.reset_accumulated_grads_()


def run_scenario(schedule, scenario, optimizer, initial, model, index, truth, held_out, targets) -> dict:
    attack = scenario["attack"] if index == schedule["attacker"] else None
    optimizer.attack = attack
    reset(optimizer, initial)
    start, step = optimizer.local_epoch, 0
    optimizer.rounds_over.clear()
    deadline = time.monotonic() + schedule["scenario_timeout"]
    while optimizer.local_epoch < scenario["until"] and time.monotonic() < deadline:
        time.sleep(schedule["compute_seconds"])
        grad = gradient(model.detach(), *batch(schedule, truth, index, 1000 * optimizer.local_epoch + step))
        step += 1
        # The 100x weight from the second round on: the first follows the barrier, and an aggregator's cap allows the
        # time since its previous round, which the barrier stretched (docs/averaging.md#robust-aggregation)
        optimizer.attack = None if attack == "weight" and optimizer.local_epoch == start else attack
        model.grad = poison(optimizer.attack, grad, optimizer.local_epoch == start)
        optimizer.step(batch_size=schedule["batch"])
    optimizer.state_averager.step(wait_for_delayed_updates=True)  # the last round's update is in
    optimizer.collect_rounds()
    optimizer.attack = None
    loss = float(((held_out @ model.detach() - targets) ** 2).mean())
    attested = [{peer: note for notes in r.attested.values() for peer, note in notes.items()}
                for r in optimizer.rounds_over]
    return {"name": scenario["name"], "loss": loss if math.isfinite(loss) else None, "start": start,
            "end": optimizer.local_epoch, "attested": attested}


def make_optimizer(dht, schedule: dict, aggregation: str, receipts):
    # the loopback timings, but a matchmaking time long enough for all four to meet on two busy cores: a pair of the
    # attacker and one honest peer is a round no rule can defend (docs/averaging.md#robust-aggregation)
    timings = dict(LOOPBACK_OPTIMIZER, matchmaking_time=schedule["matchmaking_time"])
    options = OptimizerOptions(**timings, name="adam", lr=schedule["lr"], aggregation=aggregation)
    config = RunConfig(slug="poison", run_id=f"poison_{aggregation}", task="poison", batch_size=schedule["batch"],
                       target_batch_size=PEERS * schedule["batch"] * schedule["batches_per_epoch"],
                       optimizer=options, samples_per_second_ceiling=schedule["ceiling"])
    model = torch.nn.Parameter(torch.zeros(schedule["dim"]))
    optimizer = swarm.create_optimizer(dht, config, [model], client_mode=False, receipts=receipts)
    return optimizer, model


def main(schedule_path: str, index: str, out_path: str, *initial_peers: str) -> None:
    schedule, index, out = json.loads(Path(schedule_path).read_text()), int(index), Path(out_path)
    truth, held_out, targets = problem(schedule)
    dht = hivemind.DHT(initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    if index == 0:
        Path(f"{out}.addr").write_text(json.dumps([str(addr) for addr in dht.get_visible_maddrs()]))
    folder = out.parent / f"receipts{index}"
    folder.mkdir(exist_ok=True)
    optimizers = {}
    for aggregation in ("centered_clip", "mean"):  # attestations come from the robust reducer alone
        receipts = ReceiptLog(folder) if aggregation == "centered_clip" else None
        optimizer, model = make_optimizer(dht, schedule, aggregation, receipts)
        optimizer.attack = None
        if index == schedule["attacker"]:
            patch_attacker(optimizer)
        optimizers[aggregation] = optimizer, model, copy.deepcopy(optimizer.state_averager.optimizer.state_dict())
    results = {"peer_id": str(dht.peer_id), "scenarios": []}

    def run(scenario: dict, into: list) -> None:
        optimizer, model, initial = optimizers[scenario["aggregation"]]
        into.append(run_scenario(schedule, scenario, optimizer, initial, model, index, truth, held_out, targets))

    try:
        for slot, scenarios in enumerate(schedule["slots"]):
            barrier(dht, f"slot{slot}", index)
            ran: list = []
            threads = [threading.Thread(target=run, args=(scenario, ran)) for scenario in scenarios]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            results["scenarios"].extend(ran)
            out.write_text(json.dumps(results))
    finally:
        for optimizer, _, _ in optimizers.values():
            optimizer.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
