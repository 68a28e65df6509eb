"""What spot checks cost, on the demo's model (a small ALBERT masked LM on Python's documentation).

    python -m bench.spot_checks [--mini-steps 16] [--repeats 5] [--out bench/results/spot_checks.json]

In one process, one thread, as the demo's workers train: a worker's mini-step without and with the gradient sum
the sketch needs, the sketch itself (once per epoch), and the checker's recomputation of an epoch. Times are the
thread's CPU seconds, so other load on the machine does not count. The cost to the
swarm at a spot-check rate r is r times (recomputation / a peer's epoch); the cost to each worker is the gradient
sum and the sketch. Each figure is the median of ``--repeats`` runs. See docs/spot-checks.md#cost.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from dedloc_common.contract import RunConfig

from bench import write_results

RATE = 0.02  # the default spot_check_rate (dedloc_common.contract.CheckpointOptions)


class LocalSteps:
    """hivemind's optimizer stands aside: only the worker's own work is timed."""

    def __init__(self, model):
        self.model = model

    def step(self, **_):
        pass

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)


def demo_task(folder: Path):
    from dedloc_common.tasks import validate_task
    from dedloc_worker.tasks.hf import MaskedLM

    from app.cli.demo import DEMO_OPTIMIZER, DEMO_TASK, write_corpus
    from app.runs import files as run_files

    train, held_out = write_corpus(folder / "corpus")
    options = validate_task("masked-lm", DEMO_TASK)
    stored = run_files.add_run_files(folder / "data", "demo", "masked-lm", options,
                                     {"train.txt": train, "eval.txt": held_out})
    paths = {f.name: run_files.path_of(folder / "data", "demo", f.name) for f in stored}
    config = RunConfig(slug="demo", run_id="demo", task="masked-lm", task_options=options, target_batch_size=512,
                       batch_size=16, optimizer=DEMO_OPTIMIZER)
    return config, (lambda seed: MaskedLM(options, 0, files=paths, data_seed=seed))


def epoch_seconds(task, config, mini_steps: int, sketched: bool) -> tuple[float, float, float, float]:
    """(seconds of ``mini_steps`` worker mini-steps, of which adding to the gradient sum, the epoch's sketch, the
    reseed that opens the epoch)."""
    from dedloc_worker.training import loop as trainer

    started = time.thread_time()
    tally = trainer.open_epoch(task, config, "0" * 64, 1)
    reseed = time.thread_time() - started
    added = [0.0]
    if not sketched:
        tally.gradients = None
    else:
        add = tally.gradients.add

        def timed_add(*args):
            started = time.thread_time()
            add(*args)
            added[0] += time.thread_time() - started

        tally.gradients.add = timed_add
    steps = LocalSteps(task.model)
    started = time.thread_time()
    for _ in range(mini_steps):
        trainer.mini_step(task, config, steps, tally)
    trained = time.thread_time() - started
    started = time.thread_time()
    if tally.gradients is not None:
        tally.gradients.sketch()
    return trained, added[0], time.thread_time() - started, reseed


def measure(mini_steps: int, repeats: int) -> dict:
    from dedloc_worker.training.spot_checks import recompute

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        config, build = demo_task(Path(folder))
        worker, checker = build(1), build(2)
        epoch_seconds(worker, config, 2, True)  # warm-up: data loaded, first batches tokenized
        plain, summing, sketch, reseed, check = [], [], [], [], []
        for _ in range(repeats):
            plain.append(epoch_seconds(worker, config, mini_steps, False)[0])
            _, added, sketched, reseeded = epoch_seconds(worker, config, mini_steps, True)
            summing.append(added)
            reseed.append(reseeded)
            sketch.append(sketched)
            started = time.thread_time()
            recompute(checker, config, "0" * 64, 1, mini_steps)
            check.append(time.thread_time() - started)
    parameters = sum(p.numel() for p in worker.model.parameters())
    epoch, summed, sketch_s, reseed_s, check_s = (statistics.median(x) for x in (plain, summing, sketch, reseed,
                                                                                 check))
    return {"model": "demo: ALBERT masked LM", "parameters": parameters, "mini_steps": mini_steps,
            "batch_size": config.batch_size, "repeats": repeats, "epoch_s": round(epoch, 4),
            "gradient_sum_s": round(summed, 5), "sketch_s": round(sketch_s, 5), "reseed_s": round(reseed_s, 5),
            "recompute_s": round(check_s, 4),
            "worker_overhead": round((summed + sketch_s + reseed_s) / epoch, 5),
            "swarm_cost_at_default_rate": round(RATE * check_s / epoch, 4)}


def markdown(row: dict) -> str:
    return "\n".join([
        "# Spot checks: what they cost",
        "",
        f"{row['model']}, {row['parameters']:,} parameters, one thread; an epoch of {row['mini_steps']} mini-steps of "
        f"{row['batch_size']} samples (a demo worker's share of a 512-sample step with two workers); medians of "
        f"{row['repeats']} runs (`python -m bench.spot_checks`, method in docs/spot-checks.md#cost).",
        "",
        "| what | CPU seconds |",
        "| --- | ---: |",
        f"| a worker's epoch (forward, backward, clipping) | {row['epoch_s']:.3f} |",
        f"| spot checks' part: adding to the gradient sum, per epoch | {row['gradient_sum_s']:.4f} |",
        f"| spot checks' part: the sketch, once per epoch | {row['sketch_s']:.4f} |",
        f"| spot checks' part: reseeding the data (order, masks) as the epoch opens | {row['reseed_s']:.4f} |",
        f"| the checker recomputing that epoch | {row['recompute_s']:.3f} |",
        "",
        f"Each worker pays {100 * row['worker_overhead']:.2f}% of its compute (gradient sum, sketch, reseed); at the "
        f"default rate of {RATE:.0%} the checks cost the swarm {100 * row['swarm_cost_at_default_rate']:.1f}% of its "
        "compute (at the coordinator), plus a state download per draw.",
        "",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spot_checks", description=__doc__.splitlines()[0])
    parser.add_argument("--mini-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/spot_checks.json"))
    args = parser.parse_args(argv)
    row = measure(args.mini_steps, args.repeats)
    write_results(args.out, row, markdown(row))
    print(markdown(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
