"""One configuration of ``bench.gpu`` trained in a process of its own, so that its peak memory is its own:

    python -m bench.gpu_trial '<trial as JSON>'    # prints the measured row as the last line of JSON

The worker's task class built on local files, placed as a worker places it (``training.device.choose``: autocast
in bfloat16, or float16 with a gradient scaler, on CUDA), the memory the worker predicts (``training.memory``:
``estimate``, ``probe``, ``peak``), then mini-steps with AdamW: samples per second, the loss at the start and the
end, and the peak the device reached while training (``torch.cuda.max_memory_allocated`` on CUDA; on a CPU, the
growth of the process's peak RSS over its RSS after the probe, plus the parameters, as tests/test_memory_peak.py
measures it).
"""

from __future__ import annotations

import ctypes
import gc
import json
import re
import statistics
import sys
import time
from pathlib import Path

LOSS_WINDOW = 3  # mini-steps averaged for the loss at the start and at the end: one step's loss is noisy
SEED = 1  # the run's seed: the same initial model in every trial of a configuration


def rss_of(pid: int | str, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak since the last reset) of process ``pid`` ("self": this one), in bytes;
    0 once it has ended."""
    try:
        return int(re.search(rf"{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())[1]) * 1024
    except (OSError, TypeError):
        return 0


def reset_peak(device: str) -> int:
    """Peak memory counted from now; on a CPU, the RSS now (the libraries, the tokenizer, the data read so far and
    the model's parameters), with what the probe freed given back to the system first, so it is not reused unseen."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return 0
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # the kernel's reset of VmHWM to the current RSS
    return rss_of("self", "VmRSS")


def measured_peak(device: str, before: int, parameters: int) -> tuple[int, int]:
    """(the peak the trial's training reached, the peak the whole process held): on CUDA the allocator's peak
    allocated and reserved bytes; on a CPU the growth of the peak RSS over ``before`` plus the ``parameters``' bytes,
    resident before (as tests/test_memory_peak.py measures), and the peak RSS."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    peak = rss_of("self", "VmHWM")
    return peak - before + parameters, peak


def cast_frozen(model, dtype) -> None:
    """The frozen base's parameters stored in ``dtype``: the worker keeps them as built (float32), or quantized
    (``adapter.base_bits``); an adapter run needs no float32 copy of weights it never updates."""
    for parameter in model.parameters():
        if not parameter.requires_grad:
            parameter.data = parameter.data.to(dtype)


def run(trial: dict) -> dict:
    import torch
    from dedloc_worker.tasks import load_task_class
    from dedloc_worker.tasks.adapters import trainable
    from dedloc_worker.training import device as devices
    from dedloc_worker.training import memory

    placement = devices.choose(trial["device"], trial.get("threads"))
    torch.set_num_threads(placement.threads)
    files = {name: Path(path) for name, path in trial["files"].items()}
    task = load_task_class(trial["task"])(trial["options"], SEED, files=files)
    task.to(placement.device, placement.amp)
    if trial.get("cast_frozen") and placement.amp:
        cast_frozen(task.model, getattr(torch, placement.amp))
    trained, batch = trainable(task.model), trial["batch"]
    need = memory.estimate(task.model.parameters(), trained, offload=False)
    activations = memory.probe(task, batch)
    predicted = memory.peak(need, activations, batch)

    optimizer = torch.optim.AdamW(trained, lr=trial["lr"])
    # torch's scaler, not hivemind's: hivemind's unscales only inside a hivemind.Optimizer (the swarm's workers use it)
    scaler = torch.amp.GradScaler("cuda") if placement.scaler else None
    losses: list[float] = []
    parameters = sum(p.numel() * p.element_size() for p in task.model.parameters())
    before = reset_peak(placement.device)
    for _ in range(trial["warmup"]):  # the first mini-steps read the data and warm the kernels up
        mini_step(task, optimizer, scaler, batch, trial["accumulate"], losses)
    sync(placement.device)
    began, timed = time.monotonic(), 0
    while (timed < trial["steps"]) if trial["steps"] else (time.monotonic() - began < trial["seconds"]):
        mini_step(task, optimizer, scaler, batch, trial["accumulate"], losses)
        timed += 1
    sync(placement.device)
    wall = time.monotonic() - began
    peak, process_peak = measured_peak(placement.device, before, parameters)
    return dict(
        name=trial["name"], hardware=placement.description, batch=batch, mini_steps=len(losses),
        samples_per_second=round(timed * batch / wall, 1),
        parameters=sum(p.numel() for p in task.model.parameters()), trained_parameters=sum(p.numel() for p in trained),
        parameter_bytes=sum(p.numel() * p.element_size() for p in task.model.parameters()),
        trained_bytes=sum(p.numel() * p.element_size() for p in trained),
        loss_start=round(statistics.fmean(losses[:LOSS_WINDOW]), 4),
        loss_end=round(statistics.fmean(losses[-LOSS_WINDOW:]), 4),
        estimate=dict(device=need.device, gradients=need.gradients, workspace=need.workspace,
                      activations_fixed=activations.fixed, activations_per_sample=activations.per_sample),
        predicted_peak_bytes=predicted, measured_peak_bytes=peak, process_peak_bytes=process_peak,
        predicted_over_measured=round(predicted / peak, 3))


def mini_step(task, optimizer, scaler, batch: int, accumulate: int, losses: list[float]) -> None:
    """Forward and backward on ``batch`` samples; an optimizer step every ``accumulate`` mini-steps, as a worker
    steps once per epoch."""
    loss = task.batch_loss(batch)
    (scaler.scale(loss) if scaler else loss).backward()
    losses.append(loss.item())  # the worker reads every mini-step's loss too (training.loop.mini_step)
    if len(losses) % accumulate:
        return
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad()


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
