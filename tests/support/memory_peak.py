"""Run as a script: a causal-LM task's training steps in a process of their own, printing the growth of the
process's resident memory (its peak, ``VmHWM``, reset before the first step) plus the model's parameters, which were
resident before it (tests/test_memory.py). Arguments: a JSON file with the task's options and files, the micro-batch,
and the mini-batch the micro-batches are accumulated into."""

from __future__ import annotations

import ctypes
import gc
import json
import re
import sys
from pathlib import Path

import torch


def resident(field: str) -> int:
    return int(re.search(field + r":\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def main() -> None:
    from dedloc_worker.tasks.adapters import trainable
    from dedloc_worker.tasks.hf import CausalLM

    spec, micro_batch, batch_size = json.loads(Path(sys.argv[1]).read_text()), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    task = CausalLM(spec["options"], seed=7, files={k: Path(v) for k, v in spec["files"].items()})
    task.train_stream = task.train_records()
    next(task.train_stream)  # the data's first read (tokenizing) before the measurement: it is no training memory
    optimizer = torch.optim.AdamW(trainable(task.model))
    parameters = sum(p.numel() * p.element_size() for p in task.model.parameters())
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # memory freed before the measurement is given back, not reused unseen
    before = resident("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    for _ in range(3):
        for _ in range(batch_size // micro_batch):
            (task.batch_loss(micro_batch) * micro_batch / batch_size).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(json.dumps({"measured": resident("VmHWM") - before + parameters}))


if __name__ == "__main__":
    main()
