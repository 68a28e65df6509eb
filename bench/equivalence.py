"""The paper's equivalence claim, measured: a two-peer swarm against one process with the same global batch and
the same data (docs/benchmarks.md#equivalence).

    python -m bench.equivalence [--epochs 20] [--strict-epochs 8] [--out bench/results/equivalence.json]

Each peer is a process that runs the worker's swarm code: ``dedloc_worker.swarm.node.create_dht`` and
``create_optimizer`` (hivemind's Optimizer with the worker's planned gradient averager, options from the run
config), on a tiny MLP classifier over synthetic data. Mini-batch k is drawn from a generator seeded with k, and
peer p takes k = p, p + 2, p + 4, ...: a fixed data order. Each peer records which mini-batches went into which
optimizer step (epoch), checked against the samples hivemind averaged for it, the loss of each, and the version of
the parameters it was computed at (how many optimizer steps they held). Afterwards one process (the reference)
replays exactly those mini-batches step by step with the same optimizer, initialised as hivemind initialises it,
and the same weighting as hivemind (each peer's mean gradient, weighted by its samples), computing each mini-batch's
gradient at its own parameters of the same version. Without delayed updates that version is always the step's
own; with them a step's first mini-batches were computed while the previous step ran in the background, one
version behind, and the reference does the same: so it is the same algorithm, and any gap is the swarm's error.

Rows, each one swarm run:

- ``curve``, with delayed parameter updates off and on: the loss per step in the swarm (mean over every mini-batch
  of the step, computed where the peer's parameters were) against the reference's loss on the same mini-batches at
  the same versions; ``loss_gap`` is the mean absolute difference over the steps, ``loss_gap_max`` the largest;
  ``stale_batches``: mini-batches computed one or more versions behind their step. ``loss_gap_vs_fresh``: the gap
  to a reference that computes every mini-batch at its step's own version, i.e. to training without delay (what
  delayed updates change in the curve, not an error).
- ``strict``: no delayed updates, plain mean aggregation, deterministic kernels, one thread: the largest absolute
  difference between each peer's parameters right after a step and the reference's after the same step
  (``param_diff_last_step``, and ``param_diff_max`` over the steps; ``param_diff_final``: at the peers' exit).

``rounds_formed`` counts the steps whose gradient round held both peers, as each peer's averager reports it: a step
whose round did not form is taken by each peer alone, which no single process reproduces; so a run without delayed
updates where one did not form is run again, up to ``ATTEMPTS`` times (``attempt`` says which run the row is).

A peer spends ``COMPUTE_SECONDS`` per mini-batch (a sleep: the model is too small to fill a step otherwise, and
peers that race through steps alone never meet). Results: ``equivalence.json`` and ``equivalence.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from app.core.processes import spawn, stop_all
from bench import write_results

RESULTS = Path("bench/results")
PEERS = 2
BATCH = 16
TARGET_BATCH = 640  # 40 mini-batches per step
# Longer than LOOPBACK_OPTIMIZER's: a round that does not form makes each peer step alone, which no single process
# reproduces, and on 2 shared cores 0.5 s of matchmaking missed rounds (docs/benchmarks.md#equivalence).
SWARM_TIMES = dict(matchmaking_time=1.5, averaging_timeout=15.0)
COMPUTE_SECONDS = 0.1
SEED = 0
FEATURES, HIDDEN, CLASSES = 32, 64, 10
LR = 3e-3
ATTEMPTS = 3  # runs of a configuration without delayed updates until every step's round formed
BARRIER_SECONDS = 60.0  # a finished peer serves the last round until every peer has finished, at most this long


def make_model():
    import torch

    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES))


def batch(index: int):
    """Mini-batch ``index``: inputs and the labels of a fixed random teacher, the same in every process."""
    import torch

    teacher = torch.Generator().manual_seed(10_000)
    weights = torch.randn(FEATURES, CLASSES, generator=teacher)
    generator = torch.Generator().manual_seed(index)
    inputs = torch.randn(BATCH, FEATURES, generator=generator)
    return inputs, (inputs @ weights).argmax(dim=1)


def batch_loss(model, index: int):
    import torch

    inputs, labels = batch(index)
    return torch.nn.functional.cross_entropy(model(inputs), labels)


def run_config(dpu: bool, strict: bool):
    from dedloc_common.contract import LOOPBACK_OPTIMIZER, OptimizerOptions, RunConfig

    options = dict(LOOPBACK_OPTIMIZER, **SWARM_TIMES, lr=LR, delay_optimizer_step=dpu, delay_grad_averaging=dpu)
    if strict:  # the claim is about plain averaging of float32 gradients: robust aggregation clips, fp16 rounds
        options.update(aggregation="mean", compression="none")
    return RunConfig(slug="equivalence", run_id="equivalence", task="tiny-lm", target_batch_size=TARGET_BATCH,
                     batch_size=BATCH, seed=SEED, optimizer=OptimizerOptions(**options))


def peer_main(index: int, work: Path, epochs: int, dpu: bool, strict: bool) -> None:
    """One peer: train until the swarm's step ``epochs``, write what went into each step, wait for the others."""
    import torch
    from dedloc_worker.swarm.node import create_dht
    from dedloc_worker.training.options import create_optimizer

    torch.set_num_threads(1)
    if strict:
        torch.use_deterministic_algorithms(True)
    config = run_config(dpu, strict)
    initial = [] if index == 0 else wait_for(work / "peer0.addrs").split()
    dht = create_dht(initial, "/ip4/127.0.0.1/tcp/0", client_mode=False)
    if index == 0:
        (work / "peer0.addrs").write_text(" ".join(str(a) for a in dht.get_visible_maddrs()))
    model = make_model()
    opt = create_optimizer(dht, config, model.parameters(), client_mode=False)
    (work / f"peer{index}.ready").write_text("ready")  # start together: a peer alone would take steps by itself
    for other in range(PEERS):
        wait_for(work / f"peer{other}.ready")
    deadline = time.monotonic() + 30.0  # and once each sees the other's progress: else each fills a step alone
    while opt.tracker.global_progress.num_peers < PEERS and time.monotonic() < deadline:
        time.sleep(0.2)
    steps: dict[int, dict] = {}
    pending: list[tuple[int, float, int]] = []  # (mini-batch, loss, parameters' version) since the last step
    dropped, k, began = 0, index, 0.0
    versions = Versions(model)
    try:
        while opt.local_epoch < epochs:
            version = versions.now()
            loss = batch_loss(model, k)
            loss.backward()
            time.sleep(COMPUTE_SECONDS)
            pending.append((k, loss.item(), version))
            k += PEERS
            opt.step()
            opt.zero_grad()
            for finished in opt.finished_epochs:
                members, began = last_round(opt, began)
                kept = finished.samples // BATCH
                dropped += len(pending) - kept
                kept_batches = pending[len(pending) - kept:]
                steps[finished.epoch] = dict(batches=[b for b, _, _ in kept_batches],
                                             losses=[loss for _, loss, _ in kept_batches],
                                             versions=[v for _, _, v in kept_batches], group=members,
                                             params=parameters(model), params_version=versions.now())
                pending = []
            opt.finished_epochs.clear()
            held = opt.grad_averager.local_samples_accumulated // BATCH
            if held < len(pending):  # hivemind dropped samples (state reloaded): they reached no step
                dropped += len(pending) - held
                pending = pending[len(pending) - held:]
        (work / f"peer{index}.json").write_text(json.dumps(dict(
            steps=steps, dropped=dropped, final_epoch=opt.local_epoch,
            params=parameters(model), params_version=versions.now())))
        deadline = time.monotonic() + BARRIER_SECONDS
        while time.monotonic() < deadline and not all((work / f"peer{i}.json").exists() for i in range(PEERS)):
            time.sleep(0.2)
        time.sleep(2.0)  # partners may still be receiving the last round's parts from this peer
    finally:
        opt.shutdown()
        dht.shutdown()


class Versions:
    """Counts the changes of a model's parameters: the version is how many optimizer steps they hold (hivemind
    writes a step into the model at once, or with delayed updates at a later ``step()``; never in between)."""

    def __init__(self, model):
        self.model, self.version, self.seen = model, 0, parameters(model)

    def now(self) -> int:
        current = parameters(self.model)
        if current != self.seen:
            self.version, self.seen = self.version + 1, current
        return self.version


def last_round(opt, after: float) -> tuple[list[str], float]:
    """The members of the gradient round that closed this step and when it began; [] where none formed since
    ``after`` (or it still runs in the background, with delayed updates)."""
    try:
        outcome = opt.grad_averager.last_round(timeout=2.0)
    except Exception:  # the averager is busy: unknown
        return [], after
    if outcome is None or not outcome.complete or outcome.began <= after:
        return [], after
    return list(outcome.peer_ids), outcome.began


def parameters(model) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def wait_for(path: Path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.1)
    raise RuntimeError(f"{path} did not appear within {timeout:.0f} s")


def reference(peers: list[dict], epochs: int, strict: bool, fresh: bool = False) -> tuple[list[dict], list[dict]]:
    """Replay the swarm's mini-batches in one process: per step its loss on them, and its parameters of every
    version (``snapshots[v]``: after v steps). Each
    mini-batch's gradient is computed at the reference's parameters of the version the swarm computed it at, or,
    with ``fresh``, at the step's own version (training without delay)."""
    import copy

    import torch
    from dedloc_worker.training.options import inner_optimizer

    torch.set_num_threads(1)
    if strict:
        torch.use_deterministic_algorithms(True)
    from hivemind.optim.state_averager import initialize_optimizer_state_

    model = make_model()
    optimizer = inner_optimizer(run_config(False, strict).optimizer)(model.parameters())
    # hivemind's state averager starts the optimizer with a virtual step on zero gradients (Adam's step count is 1
    # at the first real step, which then moves 0.74 lr, not lr): the reference starts the same way
    initialize_optimizer_state_(optimizer)
    snapshots = [copy.deepcopy(model.state_dict())]  # the reference's parameters of each version
    at_version = make_model()
    rows = []
    for epoch in range(epochs):
        parts = [p["steps"].get(str(epoch)) for p in peers]
        parts = [part for part in parts if part and part["batches"]]
        if not parts:
            continue
        total = sum(len(part["batches"]) for part in parts) * BATCH
        summed = [torch.zeros_like(p) for p in model.parameters()]
        losses, stale = [], 0
        for part in parts:  # hivemind's weighting: each peer's mean gradient times its samples
            mean = [torch.zeros_like(p) for p in model.parameters()]
            own = len(snapshots) - 1
            for index, version in zip(part["batches"], part.get("versions") or [own] * len(part["batches"])):
                version = own if fresh else min(version, own)
                stale += version < own
                at_version.load_state_dict(snapshots[version])
                at_version.zero_grad()
                loss = batch_loss(at_version, index)
                loss.backward()
                losses.append(loss.item())
                for acc, p in zip(mean, at_version.parameters()):
                    acc.add_(p.grad)
            weight = len(part["batches"]) * BATCH / total
            for acc, m in zip(summed, mean):
                acc.add_(m / len(part["batches"]) * weight)
        for p, grad in zip(model.parameters(), summed):
            p.grad = grad
        optimizer.step()
        snapshots.append(copy.deepcopy(model.state_dict()))
        swarm_losses = [loss for part in parts for loss in part["losses"]]
        rows.append(dict(epoch=epoch, peers=len(parts), swarm_loss=sum(swarm_losses) / len(swarm_losses),
                         reference_loss=sum(losses) / len(losses), stale_batches=stale,
                         round_formed=all(len(part["group"]) == PEERS for part in parts) and len(parts) == PEERS,
                         param_diff=max(max_difference(part["params"], version_parameters(
                             snapshots, part.get("params_version", len(snapshots) - 1))) for part in parts)))
    return rows, snapshots


def measure(mode: str, dpu: bool, epochs: int, timeout: float) -> dict:
    """One swarm run of PEERS peer processes and its reference."""
    strict = mode == "strict"
    work = Path(tempfile.mkdtemp(prefix="dedloc-equivalence-"))
    args = [str(work), str(epochs), str(int(dpu)), str(int(strict))]
    procs = [spawn([sys.executable, "-m", "bench.equivalence", "peer", str(i), *args], log=work / f"peer{i}.log")
             for i in range(PEERS)]
    options = run_config(dpu, strict).optimizer
    row = dict(mode=mode, peers=PEERS, dpu=dpu, steps=epochs, batch_size=BATCH, target_batch_size=TARGET_BATCH,
               lr=LR, aggregation=options.aggregation, compression=options.compression,
               matchmaking_time=options.matchmaking_time)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(proc.poll() is None for proc in procs):
            time.sleep(0.5)
    finally:
        stop_all(procs)
    results = [work / f"peer{i}.json" for i in range(PEERS)]
    if not all(path.exists() for path in results):
        tail = (work / "peer0.log").read_text()[-400:] if (work / "peer0.log").exists() else ""
        return dict(row, error=f"a peer did not finish within {timeout:.0f} s (logs in {work}): {tail}")
    peers = [json.loads(path.read_text()) for path in results]
    shutil.rmtree(work, ignore_errors=True)
    steps, snapshots = reference(peers, epochs, strict)
    gaps = [abs(s["swarm_loss"] - s["reference_loss"]) for s in steps]
    fresh, _ = reference(peers, epochs, strict, fresh=True)
    fresh_gaps = [abs(s["swarm_loss"] - f["reference_loss"]) for s, f in zip(steps, fresh)]
    row.update(compared_steps=len(steps), steps_with_both_peers=sum(s["peers"] == PEERS for s in steps),
               dropped_batches=sum(p["dropped"] for p in peers), loss_gap=round(sum(gaps) / len(gaps), 6),
               loss_gap_max=round(max(gaps), 6), loss_gap_vs_fresh=round(sum(fresh_gaps) / len(fresh_gaps), 6),
               stale_batches=sum(s["stale_batches"] for s in steps), first_loss=round(steps[0]["reference_loss"], 4),
               last_loss=round(steps[-1]["reference_loss"], 4), curve=steps)
    row.update(rounds_formed=sum(s["round_formed"] for s in steps), param_diff_last_step=steps[-1]["param_diff"],
               param_diff_max=max(s["param_diff"] for s in steps),
               param_diff_final=max(max_difference(p["params"], version_parameters(snapshots, p["params_version"]))
                                    for p in peers))
    for step in steps:
        step["param_diff"] = float(f"{step['param_diff']:.3g}")
    return row


def version_parameters(snapshots: list[dict], version: int) -> list[list[float]]:
    """The reference's parameters of ``version`` (the newest it has, if the swarm's is ahead), flattened."""
    return [tensor.flatten().tolist() for tensor in snapshots[min(version, len(snapshots) - 1)].values()]


def max_difference(left: list[list[float]], right: list[list[float]]) -> float:
    return max(abs(a - b) for x, y in zip(left, right) for a, b in zip(x, y))


def markdown(rows: list[dict]) -> str:
    lines = ["# Equivalence: a two-peer swarm against one process", "",
             "Written by `python -m bench.equivalence` (part of `make bench`): two peers running the worker's swarm "
             "code on a tiny MLP (synthetic data,", f"a fixed order), global batch {TARGET_BATCH} of mini-batches of "
             f"{BATCH}, AdamW lr {LR}, against one process replaying the same mini-batches per step. Loss gap: mean "
             "(max) |swarm - reference| of",
             "the per-step loss, the reference computing each mini-batch at the parameters' version",
             "the swarm computed it at "
             "(with delayed updates a step's first mini-batches are one version behind: stale); vs fresh: against "
             "training without delay. strict: no delayed updates, plain mean, float32 gradients, deterministic "
             "kernels; the curves compress gradients as the run's default does (the reference averages float32).",
             "Rounds formed: steps whose gradient round held both peers (not checked with delayed updates, "
             "whose rounds close in the background). Method: docs/benchmarks.md#equivalence.", "",
             "| mode | dpu | compression | steps | rounds formed | loss first -> last | loss gap mean | loss gap max | "
             "stale batches | loss gap vs fresh | params diff, last step | params diff, max | dropped batches | run |",
             "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {'on' if r['dpu'] else 'off'} | error: {r['error'][:80]} |")
            continue
        lines.append(f"| {r['mode']} | {'on' if r['dpu'] else 'off'} | {r.get('compression', 'none')} | "
                     f"{r['compared_steps']} | "
                     f"{'-' if r['dpu'] else r['rounds_formed']} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} | "
                     f"{r['loss_gap']:.4f} | {r['loss_gap_max']:.4f} | {r['stale_batches']} | "
                     f"{r['loss_gap_vs_fresh']:.4f} | {r['param_diff_last_step']:.1e} | "
                     f"{r['param_diff_max']:.1e} | {r['dropped_batches']} | {r.get('attempt', 1)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "peer":
        index, work, epochs, dpu, strict = sys.argv[2:7]
        peer_main(int(index), Path(work), int(epochs), dpu == "1", strict == "1")
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.equivalence")
    parser.add_argument("--epochs", type=int, default=20, help="optimizer steps of the loss-curve runs")
    parser.add_argument("--strict-epochs", type=int, default=8, help="optimizer steps of the strict run")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per swarm run, at most")
    parser.add_argument("--out", type=Path, default=RESULTS / "equivalence.json")
    args = parser.parse_args(argv)
    rows = []
    for mode, dpu, epochs in (("strict", False, args.strict_epochs), ("curve", False, args.epochs),
                              ("curve", True, args.epochs)):
        for attempt in range(1, ATTEMPTS + 1):
            row = dict(measure(mode, dpu, epochs, args.timeout), attempt=attempt)
            # without delayed updates every step's round must form for the comparison to mean anything (module
            # doc); with them the round of a step closes in the background and is not checked per step
            if dpu or row.get("rounds_formed") == row.get("compared_steps"):
                break
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
    write_results(args.out, rows, markdown(rows))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
