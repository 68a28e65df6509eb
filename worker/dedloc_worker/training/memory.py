"""What a run's model needs in memory on this machine, before the worker joins its swarm, and the micro-batch that
fits.

Two parts. The model's own memory is counted from the model the worker built (exact, not modelled): its parameters as
they are stored, the gradients of the trained ones, and the inner optimizer's two moments (Adam, AdamW and LAMB keep
two float32 tensors per trained parameter). Where hivemind offloads the optimizer (a large-batch run:
``offload_optimizer``), the moments, a float32 master copy of the trained parameters and the averaged gradients live
in host memory, not on the device.

What a mini-step holds beyond that (activations, the gradients as backward builds them, the loss's temporaries) is
measured, not modelled: ``probe`` runs the task's own forward and backward at two micro-batches on the training
device, counting every tensor they create while it lives (``LiveTensors``: on any device, so on a CPU as on a
GPU), and fits a line: a fixed part and a part per sample. The activations of any micro-batch follow from the line;
docs/memory.md has the figures it was checked against.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dedloc_worker.errors import ResourceError, TrainingError, WorkerError

MOMENTS = 2  # float32 tensors per trained parameter in Adam, AdamW and LAMB
BNB_MIN_8BIT, BNB_BLOCK = 4096, 256  # bitsandbytes' 8-bit optimizers: min_8bit_size and the blockwise block
GIB = 1024**3
MIB = 1024**2
PROBE_SAMPLES = (1, 4)  # the micro-batches a probe runs: far enough apart that the line's slope is not noise
# The optimizer's step allocates temporaries of the trained parameters' size (torch's foreach Adam), on the device
# unless hivemind offloads it: one float32 copy, as measured in docs/memory.md.
STEP_WORKSPACE = 1


def moment_size(count: int, moment_bytes: int) -> int:
    """Bytes of one optimizer moment of a tensor of ``count`` elements. bitsandbytes' 8-bit moments add a float32
    scale per block and a code table per tensor, and keep tensors too small to gain in float32."""
    if moment_bytes != 1 or count < BNB_MIN_8BIT:
        return 4 * count
    return count + 4 * -(-count // BNB_BLOCK) + 4 * 256


@dataclass(frozen=True)
class Activations:
    """Bytes a mini-step holds beyond the model's parameters: ``fixed`` whatever the micro-batch, ``per_sample`` more
    for each sample in it."""

    fixed: int
    per_sample: int

    def at(self, micro_batch: int) -> int:
        return self.fixed + self.per_sample * micro_batch


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a worker holds before any activation: ``device`` on the training device, ``host`` in RAM besides."""

    device: int
    host: int
    workspace: int = 0  # the optimizer step's temporaries on the device, a moment beside the rest
    gradients: int = 0  # of ``device``: the trained parameters' gradients (a probe counts them as backward makes them)

    def describe(self) -> str:
        return f"{self.device / GIB:.2f} GiB on the device and {self.host / GIB:.2f} GiB of RAM before activations"


def estimate(parameters: Iterable[torch.nn.Parameter], trained: Iterable[torch.nn.Parameter],
             offload: bool, moment_bytes: int = 4) -> MemoryNeed:
    """The memory of a model's ``parameters`` of which ``trained`` are trained (the rest frozen: an adapter run's
    base), with the optimizer offloaded to the host or not; ``moment_bytes`` per moment and parameter (1: bitsandbytes'
    8-bit moments)."""
    stored = sum(p.numel() * p.element_size() for p in parameters)
    trained = list(trained)
    gradients = sum(p.numel() * p.element_size() for p in trained)
    count = sum(p.numel() for p in trained)
    moments = MOMENTS * sum(moment_size(p.numel(), moment_bytes) for p in trained)
    if offload:  # hivemind's offloaded optimizer: fp32 master copy, moments, averaged gradients, all on the host
        return MemoryNeed(device=stored + gradients, host=4 * count + moments + 4 * count, gradients=gradients)
    return MemoryNeed(device=stored + gradients + moments, host=0, workspace=STEP_WORKSPACE * 4 * count,
                      gradients=gradients)


def probe(task, micro_batch: int) -> Activations:
    """What the task's mini-steps hold beyond its parameters, measured at ``PROBE_SAMPLES`` samples (none above
    ``micro_batch``) on the device the task is on. The RNG and gradients are left as they were; the samples read are
    the stream's (a worker's next epoch redraws its batches anyway). ``ResourceError`` where the smallest probe does
    not fit the device."""
    device = next(task.model.parameters()).device
    sizes = sorted({min(n, micro_batch) for n in PROBE_SAMPLES})
    held = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for n in sizes:
            try:
                with LiveTensors() as tensors:
                    task.batch_loss(n).backward()
            except torch.OutOfMemoryError:
                if n == sizes[0]:
                    raise ResourceError(f"one sample of this run does not fit the {device.type} device's free "
                                        "memory: use a larger GPU, --device cpu, or ask the organizers for an "
                                        "adapter run") from None
                break
            except WorkerError:
                raise
            except Exception as e:  # a task is a plugin: one line, as a failing mini-step is (training.loop)
                raise TrainingError(f"task {type(task).__name__} failed while its memory was measured: "
                                    f"{type(e).__name__}: {e}") from e
            finally:
                task.model.zero_grad(set_to_none=True)
            held[n] = tensors.peak
    if len(held) < 2:
        (n, bytes_), = held.items()
        return Activations(fixed=0, per_sample=-(-bytes_ // n))
    (small, at_small), (large, at_large) = min(held.items()), max(held.items())
    per_sample = max(0, (at_large - at_small) // (large - small))
    return Activations(fixed=max(0, at_small - per_sample * small), per_sample=per_sample)


class LiveTensors(TorchDispatchMode):
    """The bytes of the tensors created while it is active that are still alive (``live``), and their ``peak``.
    torch's own ``MemTracker`` does this too, but fails on a model with frozen parameters (an adapter run's base)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._tracked: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                storage = tensor.untyped_storage()  # views share it: a storage counts once, until it is freed
                if id(storage) not in self._tracked:
                    size = storage.nbytes()
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    self._tracked[id(storage)] = weakref.finalize(storage, self._freed, id(storage), size)
        return out

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._tracked.pop(key, None)


def fit_micro_batch(need: MemoryNeed, activations: Activations, batch_size: int, free: int) -> Optional[int]:
    """The largest micro-batch that divides ``batch_size`` (the run's samples per mini-step, reached by accumulating
    micro-batches) and fits ``free`` bytes on the device with the model; None where not even one sample does."""
    for micro_batch in sorted((d for d in range(1, batch_size + 1) if batch_size % d == 0), reverse=True):
        if peak(need, activations, micro_batch) <= free:
            return micro_batch
    return None


def peak(need: MemoryNeed, activations: Activations, micro_batch: int) -> int:
    """Bytes a worker's device holds at most while it trains at ``micro_batch``: the model, and the larger of a
    mini-step's activations (with the gradients backward makes, as the probe counts them) and the optimizer step's
    temporaries beside the gradients (the two never overlap)."""
    return need.device - need.gradients + max(activations.at(micro_batch), need.gradients + need.workspace)


def free_memory(device: str) -> int:
    """Bytes free now on the training device: the GPU's as CUDA reports them, or the RAM the OS says is available."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    import psutil

    return psutil.virtual_memory().available


def check_fits(need: MemoryNeed, device: str, device_free: Optional[int] = None,
               host_free: Optional[int] = None) -> None:
    """``ResourceError`` (one line, what would fit) when ``need`` exceeds what this machine has free now; the free
    figures are read from torch and the OS when not given."""
    if device_free is None and device == "cuda":
        device_free = free_memory("cuda")
    if host_free is None:
        host_free = free_memory("cpu")
    on_host = need.host + (need.device if device == "cpu" else 0)
    if device == "cuda" and device_free is not None and need.device > device_free:
        raise ResourceError(f"this run's model needs {need.device / GIB:.2f} GiB on the GPU before activations and "
                            f"the GPU has {device_free / GIB:.2f} GiB free: join with --device cpu, use a larger "
                            "GPU, or ask the organizers for an adapter run")
    if on_host > host_free:
        raise ResourceError(f"this run's model needs {on_host / GIB:.2f} GiB of RAM before activations and "
                            f"{host_free / GIB:.2f} GiB are free: close other programs or use a larger machine")


def choose_micro_batch(task, need: MemoryNeed, batch_size: int, device: str,
                       free: Optional[int] = None) -> tuple[int, Activations]:
    """The micro-batch this worker trains at (``fit_micro_batch``) and the activations it measured; ``ResourceError``
    in one line where not even one sample fits."""
    activations = probe(task, batch_size)
    free = free_memory(device) if free is None else free
    if device == "cpu":
        free -= need.host  # the offloaded optimizer shares the RAM
    micro_batch = fit_micro_batch(need, activations, batch_size, free)
    if micro_batch is None:
        one = peak(need, activations, 1)
        where = "on the GPU" if device == "cuda" else "of RAM"
        raise ResourceError(f"this run needs {size(one)} {where} at one sample per micro-batch and "
                            f"{size(free)} are free: use a larger GPU, --device cpu, or ask the organizers "
                            "for an adapter run")
    return micro_batch, activations


def describe(need: MemoryNeed, activations: Activations, micro_batch: int, batch_size: int, device: str) -> str:
    """The worker's memory line: what training needs at its micro-batch, and how it reaches the run's mini-batch."""
    where = "on the GPU" if device == "cuda" else "of RAM"
    line = (f"this run needs {size(peak(need, activations, micro_batch))} {where} at {micro_batch} "
            f"sample{'s' if micro_batch != 1 else ''} per micro-batch ({size(need.device)} for the model, "
            f"{size(activations.per_sample)} more per sample)")
    if need.host:
        line += f", and {size(need.host)} of RAM for the offloaded optimizer"
    if micro_batch < batch_size:
        line += (f"; the run's {batch_size} samples per mini-step do not fit at once: {batch_size // micro_batch} "
                 f"micro-batches of {micro_batch}, accumulated")
    return line


def size(count: int) -> str:
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / MIB:.1f} MiB"


def report(need: MemoryNeed, activations: Activations, micro_batch: int, device: str, precision: Optional[str]):
    """The figures a worker's metrics record carries (``contract.MemoryReport``)."""
    from dedloc_common.contract import MemoryReport

    return MemoryReport(device=device, precision=precision or "float32", model_bytes=need.device,
                        host_bytes=need.host, fixed_bytes=activations.fixed, per_sample_bytes=activations.per_sample,
                        peak_bytes=peak(need, activations, micro_batch), micro_batch=micro_batch)
