"""float16 with hivemind's GradScaler on CUDA, an overflow forced (``bench.gpu`` runs it there; on a CPU,
tests/test_fp16.py runs the same with the scaler set up for the CPU): the worker's own mini-step
(``training.loop.mini_step``) and collaborative optimizer on a one-peer swarm, autocast to float16. Prints one JSON
line: the scale before and after the overflow, whether the overflowed mini-step was counted, the samples the epoch
then closed with, and whether the step was taken."""

from __future__ import annotations

import gc
import json

import hivemind
import torch
from dedloc_common.contract import OptimizerOptions, RunConfig

BATCH, TARGET = 4, 16


class OverflowingTask:
    """A regression on the GPU whose loss is huge on the mini-steps named in ``overflow_at``: its float16 gradients
    overflow there, as a forward pass that overflowed gives them."""

    autocast = torch.float16  # what makes the training loop use hivemind's GradScaler

    def __init__(self, overflow_at: set[int]):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1).cuda()
        self.overflow_at, self.calls = overflow_at, 0

    def batch_loss(self, batch_size: int) -> torch.Tensor:
        x = torch.randn(batch_size, 4, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = ((self.model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        self.calls += 1
        return loss * 6e4 if self.calls in self.overflow_at else loss  # float16's largest is 65,504


def main() -> None:
    from dedloc_worker.training.loop import EpochTally, grad_scaler, mini_step
    from dedloc_worker.training.options import create_optimizer

    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    config = RunConfig(slug="fp16", run_id="fp16", task="x:Y", target_batch_size=TARGET, batch_size=BATCH,
                       optimizer=OptimizerOptions(matchmaking_time=0.5, averaging_timeout=2.0,
                                                  delay_optimizer_step=False, delay_grad_averaging=False))
    task = OverflowingTask(overflow_at={2})
    opt = create_optimizer(dht, config, task.model.parameters(), client_mode=False)
    try:
        scaler = grad_scaler(task)  # hivemind's, as the worker makes it
        result = dict(scale_before=scaler.get_scale())
        mini_step(task, config, opt, EpochTally(0), scaler)
        tally = EpochTally(0)
        result["overflow_rejected"] = not mini_step(task, config, opt, tally, scaler)
        result.update(scale_after=scaler.get_scale(), overflow_counted=tally.mini_steps)
        before = [p.detach().clone() for p in task.model.parameters()]
        tally = EpochTally(0)  # as the loop opens the epoch again
        while opt.local_epoch == 0 and tally.mini_steps < 100:
            mini_step(task, config, opt, tally, scaler)
        result.update(epoch_samples=opt.finished_epochs[-1].samples if opt.finished_epochs else 0,
                      mini_steps_after=tally.mini_steps,
                      stepped=any(not torch.equal(a, b) for a, b in zip(before, task.model.parameters())))
        print(json.dumps(result), flush=True)
    finally:
        opt.shutdown()
        dht.shutdown()
        gc.collect()


if __name__ == "__main__":
    main()
