"""What a run's model needs in memory on this machine, before the worker joins its swarm.

Counted from the model the worker built (exact, not modelled): its parameters as they are stored, the gradients of
the trained ones, and the inner optimizer's two moments (Adam, AdamW and LAMB keep two float32 tensors per trained
parameter). Where hivemind offloads the optimizer (a large-batch run: ``offload_optimizer``), the moments, a float32
master copy of the trained parameters and the averaged gradients live in host memory, not on the device.
Activations are not counted: they depend on the micro-batch, and the worker checks only what no micro-batch can save.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from dedloc_worker.errors import ResourceError

MOMENTS = 2  # float32 tensors per trained parameter in Adam, AdamW and LAMB
GIB = 1024**3


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a worker holds before any activation: ``device`` on the training device, ``host`` in RAM besides."""

    device: int
    host: int

    def describe(self) -> str:
        return f"{self.device / GIB:.2f} GiB on the device and {self.host / GIB:.2f} GiB of RAM before activations"


def estimate(parameters: Iterable[torch.nn.Parameter], trained: Iterable[torch.nn.Parameter],
             offload: bool) -> MemoryNeed:
    """The memory of a model's ``parameters`` of which ``trained`` are trained (the rest frozen: an adapter run's
    base), with the optimizer offloaded to the host or not."""
    stored = sum(p.numel() * p.element_size() for p in parameters)
    trained = list(trained)
    gradients = sum(p.numel() * p.element_size() for p in trained)
    count = sum(p.numel() for p in trained)
    moments = MOMENTS * 4 * count
    if offload:  # hivemind's offloaded optimizer: fp32 master copy, moments, averaged gradients, all on the host
        return MemoryNeed(device=stored + gradients, host=4 * count + moments + 4 * count)
    return MemoryNeed(device=stored + gradients + moments, host=0)


def check_fits(need: MemoryNeed, device: str, device_free: Optional[int] = None,
               host_free: Optional[int] = None) -> None:
    """``ResourceError`` (one line, what would fit) when ``need`` exceeds what this machine has free now; the free
    figures are read from torch and the OS when not given."""
    if device_free is None and device == "cuda":
        device_free = torch.cuda.mem_get_info()[0]
    if host_free is None:
        import psutil

        host_free = psutil.virtual_memory().available
    on_host = need.host + (need.device if device == "cpu" else 0)
    if device == "cuda" and device_free is not None and need.device > device_free:
        raise ResourceError(f"this run's model needs {need.device / GIB:.2f} GiB on the GPU before activations and "
                            f"the GPU has {device_free / GIB:.2f} GiB free: join with --device cpu, use a larger "
                            "GPU, or ask the organizers for an adapter run")
    if on_host > host_free:
        raise ResourceError(f"this run's model needs {on_host / GIB:.2f} GiB of RAM before activations and "
                            f"{host_free / GIB:.2f} GiB are free: close other programs or use a larger machine")
