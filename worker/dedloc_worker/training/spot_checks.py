"""Spot checks, the worker's half: each epoch's batches drawn from (run seed, peer key, epoch) alone, and a sketch
of the gradient a peer accumulated in the epoch, published with its claim (``EpochContribution.sketch``).

A checker that holds the model's parameters of an epoch (the coordinator's, ``app/coordinator/spot_checker.py``)
redraws a peer's batches of that epoch, recomputes the gradient with ``recompute`` and compares the two sketches
(``app/credit/spot_checks.py``). The sketch is a count sketch (Charikar, Chen and Farach-Colton 2002): every
coordinate of the gradient goes, with a random sign, into one of ``SKETCH_DIMS`` buckets, both drawn from the run's
seed, so inner products and cosine similarity survive in expectation. A peer pays one extra copy of its gradient and
one pass over it per epoch; its record carries 64 numbers more (``contract.encode_sketch``).

Only tasks with ``reseed(seed)`` (the next batches come from ``seed`` alone) can be checked: tiny-lm, and the Hugging
Face tasks on the run's files; others publish no sketch. docs/spot-checks.md says what a sketch cannot catch.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Iterable, List, Optional, Tuple

import torch
from dedloc_common.contract import encode_sketch

SKETCH_DIMS = 64
CHUNK = 1 << 20  # coordinates per draw of buckets and signs: bounds the memory a sketch takes on large models


def epoch_seed(run_seed: int, peer_key: str, epoch: int) -> int:
    """The seed of a peer's batches in ``epoch``: anyone who knows the run and the peer's key can redraw them."""
    digest = hashlib.sha256(f"dedloc data {run_seed} {peer_key} {epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # a torch.Generator seed


def checkable(task) -> bool:
    """Whether the task draws its batches from a seed it is given (``reseed``, unless it says ``reseedable`` no)."""
    from dedloc_worker.tasks import Reseedable

    return isinstance(task, Reseedable) and bool(getattr(task, "reseedable", True))


class GradientSum:
    """The sum of a model's gradients over an epoch's mini-steps, as the peer hands them to the optimizer (after
    clipping, unscaled). Its sketch is what the peer publishes."""

    def __init__(self, run_seed: int):
        self.run_seed = run_seed
        self.tensors: Optional[List[torch.Tensor]] = None

    def add(self, params: Iterable[torch.nn.Parameter], scale: float = 1.0) -> None:
        grads = [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in params]
        if self.tensors is None:
            self.tensors = [torch.zeros_like(g, dtype=torch.float32) for g in grads]
        # one call for all tensors: per tensor, a small model's adds cost more in Python than in arithmetic
        torch._foreach_add_(self.tensors, [g if g.dtype == torch.float32 else g.float() for g in grads],
                            alpha=1.0 / scale)

    def sketch(self) -> str:
        """The sketch as a claim carries it (``contract.encode_sketch``); "" when nothing was added."""
        return "" if self.tensors is None else encode_sketch(sketch_of(self.tensors, self.run_seed))


def sketch_of(tensors: Iterable[torch.Tensor], run_seed: int, dims: int = SKETCH_DIMS) -> List[float]:
    """The count sketch of ``tensors`` flattened in order; the buckets and signs come from ``run_seed``."""
    generator = torch.Generator().manual_seed(int(run_seed) & (2**63 - 1))
    out = torch.zeros(dims, dtype=torch.float64)
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).to("cpu", torch.float64)
        for start in range(0, flat.numel(), CHUNK):
            part = flat[start:start + CHUNK]
            buckets = torch.randint(0, dims, (part.numel(),), generator=generator)
            signs = torch.randint(0, 2, (part.numel(),), generator=generator).to(torch.float64).mul_(2).sub_(1)
            out.index_add_(0, buckets, part * signs)
    return [float(value) for value in out]


def recompute(task, config, peer_key: str, epoch: int, mini_steps: int,
              halt: Optional[threading.Event] = None) -> Optional[Tuple[str, float]]:
    """(sketch, mean loss per mini-step) of what the peer ``peer_key`` should have accumulated in ``epoch``: its
    ``mini_steps`` batches redrawn and run through ``task.model`` with the parameters it holds now, as
    ``training.loop.mini_step`` does (the run's gradient clipping included). None when ``halt`` is set meanwhile."""
    from dedloc_worker.tasks.adapters import trainable

    task.reseed(epoch_seed(config.seed, peer_key, epoch))
    total, loss_sum = GradientSum(config.seed), 0.0
    params = trainable(task.model)
    for _ in range(mini_steps):
        if halt is not None and halt.is_set():
            return None
        task.model.zero_grad(set_to_none=True)
        loss = task.batch_loss(config.batch_size)
        loss.backward()
        if config.optimizer.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, config.optimizer.clip_grad_norm)
        total.add(params)
        loss_sum += float(loss.item())
    task.model.zero_grad(set_to_none=True)
    return total.sketch(), loss_sum / max(mini_steps, 1)
