"""float16 training with hivemind's GradScaler, on the CPU with a forced overflow: the scale shrinks after it, the
rejected mini-step is neither counted nor sketched, the epoch's dropped gradients are dropped from its claim too,
and training goes on (bench/gpu_fp16.py repeats this on CUDA with autocast, in `make bench-gpu`)."""

from __future__ import annotations

import gc
import threading

import hivemind
import pytest
import torch
from dedloc_common.contract import OptimizerOptions, RunConfig

pytestmark = [pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


class OverflowingTask:
    """A linear regression whose loss is huge on the mini-steps named in ``overflow_at``: scaled, its gradients are
    infinite, as a float16 forward pass that overflowed gives them."""

    autocast = torch.float16  # what makes the training loop use hivemind's GradScaler
    reseedable = False

    def __init__(self, overflow_at: set[int]):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.overflow_at, self.calls = overflow_at, 0

    def batch_loss(self, batch_size: int) -> torch.Tensor:
        x = torch.randn(batch_size, 4)
        loss = ((self.model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        self.calls += 1
        return loss * 1e33 if self.calls in self.overflow_at else loss  # finite; times the scale, not


def cpu_grad_scaler() -> hivemind.GradScaler:
    """hivemind's GradScaler as it runs on a GPU, here on the CPU: torch's CUDA scaler turns itself off without CUDA,
    so its torch part is set up for the CPU (``torch.amp.GradScaler("cpu")``), hivemind's part as its ``__init__``
    sets it up."""
    scaler = hivemind.GradScaler.__new__(hivemind.GradScaler)
    torch.amp.GradScaler.__init__(scaler, "cpu")
    scaler._is_running_global_step = scaler._is_ready_to_update = False
    scaler._inner_optimizer_states, scaler._optimizer_states_to_reset = {}, set()
    scaler._lock = threading.RLock()
    return scaler


def test_an_overflow_shrinks_the_scale_drops_the_epochs_gradients_and_training_goes_on():
    from dedloc_worker.training.loop import EpochTally, mini_step
    from dedloc_worker.training.options import create_optimizer

    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    config = RunConfig(slug="fp16", run_id="fp16", task="x:Y", target_batch_size=16, batch_size=4,
                       optimizer=OptimizerOptions(matchmaking_time=0.5, averaging_timeout=2.0,
                                                  delay_optimizer_step=False, delay_grad_averaging=False))
    task = OverflowingTask(overflow_at={2})
    opt = create_optimizer(dht, config, task.model.parameters(), client_mode=False)
    try:
        scaler = cpu_grad_scaler()
        scale = scaler.get_scale()
        tally = EpochTally(0)
        assert mini_step(task, config, opt, tally, scaler)  # a finite one: counted, accumulated
        assert (tally.mini_steps, opt.grad_averager.local_samples_accumulated) == (1, 4)
        assert not mini_step(task, config, opt, tally, scaler)  # the overflow
        assert scaler.get_scale() == scale / 2
        assert tally.mini_steps == 1  # not counted
        assert opt.grad_averager.local_samples_accumulated == 0  # hivemind dropped the epoch's gradients
        tally = EpochTally(0)  # as the loop opens the epoch again
        before = [p.detach().clone() for p in task.model.parameters()]
        while opt.local_epoch == 0:
            assert mini_step(task, config, opt, tally, scaler)
        assert tally.mini_steps == 4 and opt.finished_epochs[-1].samples == 16  # the epoch after the overflow only
        assert any(not torch.equal(a, b) for a, b in zip(before, task.model.parameters()))  # the step was taken
    finally:
        opt.shutdown()
        dht.shutdown()
        gc.collect()
