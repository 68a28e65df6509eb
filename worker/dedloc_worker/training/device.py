"""Where a worker trains: the device (``--device auto|cpu|cuda``), mixed precision on GPUs, CPU threads, and
which GPUs ``--devices`` names."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dedloc_worker.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Placement:
    """The device a worker trains on and how: ``amp`` is the autocast dtype name ("bfloat16", "float16") or None;
    ``scaler`` says fp16 needs hivemind's gradient scaler (bf16 does not)."""

    device: str
    amp: Optional[str]
    threads: int
    description: str

    @property
    def scaler(self) -> bool:
        return self.amp == "float16"


def choose(requested: str = "auto", threads: Optional[int] = None, cuda_available: Optional[bool] = None,
           bf16_supported: Optional[bool] = None, gpu_name: Optional[str] = None,
           visible: Optional[str] = None) -> Placement:
    """The placement for ``requested``; ``ConfigError`` for cuda on a machine without one. The keyword arguments
    describe the machine (read from torch, and ``visible`` from ``CUDA_VISIBLE_DEVICES``, when None), so the choice
    is testable anywhere."""
    import torch

    if requested not in DEVICES:
        raise ConfigError(f"--device {requested!r}: use one of {', '.join(DEVICES)}")
    has_cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if requested == "cuda" and not has_cuda:
        raise ConfigError("--device cuda: this machine has no CUDA GPU torch can use (torch.cuda.is_available() is "
                          "False); install a CUDA build of torch, or use --device cpu")
    threads = threads or physical_cores()
    if requested == "cpu" or not has_cuda:
        return Placement("cpu", None, threads, f"cpu: {threads} thread{'s' if threads != 1 else ''}")
    bf16 = torch.cuda.is_bf16_supported() if bf16_supported is None else bf16_supported
    name = gpu_name if gpu_name is not None else torch.cuda.get_device_name(0)
    amp = "bfloat16" if bf16 else "float16"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "") if visible is None else visible
    # One GPU of several (each of `--devices` is a process shown one): its index tells the peers on /me apart.
    which = f"GPU {visible.strip()}, " if visible.strip() and "," not in visible else ""
    return Placement("cuda", amp, threads, f"cuda: {name} ({which}{amp} mixed precision)")


def gpus(requested: str, gpu_count: Optional[int] = None) -> list[int]:
    """The GPU indices ``--devices`` names: every one for "all", else the comma-separated indices ("0,2") in the
    order given. ``ConfigError`` for anything else, an index named twice or past this machine's GPUs, and on a
    machine without one. ``gpu_count`` describes the machine (``torch.cuda.device_count()`` when None)."""
    listed = requested.replace(" ", "")
    if listed != "all" and not re.fullmatch(r"[0-9]+(,[0-9]+)*", listed):
        raise ConfigError(f"--devices {requested!r}: use all, or GPU indices separated by commas, such as 0,2")
    if gpu_count is None:
        import torch

        gpu_count = torch.cuda.device_count()
    if gpu_count == 0:
        raise ConfigError(f"--devices {requested}: this machine has no CUDA GPU torch can use "
                          "(torch.cuda.device_count() is 0); run without --devices to train on the CPU, or install a "
                          "CUDA build of torch")
    if listed == "all":
        return list(range(gpu_count))
    indices = [int(index) for index in listed.split(",")]
    twice = next((index for index in indices if indices.count(index) > 1), None)
    if twice is not None:
        raise ConfigError(f"--devices {requested}: GPU {twice} is named twice; name each GPU once")
    beyond = next((index for index in indices if index >= gpu_count), None)
    if beyond is not None:
        have = "1 CUDA GPU, 0" if gpu_count == 1 else f"{gpu_count} CUDA GPUs, 0 to {gpu_count - 1}"
        raise ConfigError(f"--devices {requested}: there is no GPU {beyond}; this machine has {have} "
                          "(torch.cuda.device_count())")
    return indices


def physical_cores(sys_root: Path = Path("/sys/devices/system/cpu")) -> int:
    """Physical cores this process may use: hyper-thread siblings count once (torch's matmuls gain nothing from
    them). Falls back to the logical count where the topology cannot be read."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        siblings = sys_root / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            return len(allowed)
    return max(1, len(cores))
