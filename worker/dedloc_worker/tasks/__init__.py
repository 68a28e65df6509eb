"""What a run trains: the built-in tasks and plugins.

Every task is a ``Task``; the built-in ones also are ``Placeable``, ``Evaluated``, ``Saved`` and ``Reseedable``,
which a plugin may be too (the worker asks with ``isinstance``). A run names a built-in task
(``dedloc_common.tasks.BUILT_IN``) or a plugin by ``"module:attr"``, built as ``Task(options, seed)``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Protocol, runtime_checkable

from dedloc_worker.errors import ConfigError

if TYPE_CHECKING:
    import torch


@runtime_checkable
class Task(Protocol):
    """What a run trains: ``model``, and the mean loss of ``batch_size`` samples from this worker's data stream."""

    model: "torch.nn.Module"

    def batch_loss(self, batch_size: int) -> "torch.Tensor": ...


@runtime_checkable
class Placeable(Protocol):
    """A task that moves itself to a device, with mixed precision (``amp``: "float16", "bfloat16" or None)."""

    def to(self, device: str, amp: Optional[str] = None) -> Any: ...


@runtime_checkable
class Evaluated(Protocol):
    """A task with held-out data: ``evaluate()`` is its loss there (None: no held-out data)."""

    def evaluate(self) -> Optional[float]: ...


@runtime_checkable
class Saved(Protocol):
    """A task that saves its model in Hugging Face format (what checkpoints hold)."""

    def save(self, folder: Path) -> None: ...


@runtime_checkable
class Reseedable(Protocol):
    """A task that draws its batches from a seed it is given: what spot checks redraw. One whose data cannot be
    redrawn this time (a stream) also says ``reseedable = False``."""

    def reseed(self, seed: int) -> None: ...

REGISTRY = {
    "tiny-lm": "dedloc_worker.tasks.tiny_lm:TinyLanguageModel",
    "masked-lm": "dedloc_worker.tasks.hf:MaskedLM",
    "causal-lm": "dedloc_worker.tasks.hf:CausalLM",
    "image-classification": "dedloc_worker.tasks.hf:ImageClassification",
}


def load_task_class(name: str):
    """The task class a run names; ``ConfigError`` when it cannot be found."""
    target = REGISTRY.get(name, name)
    module_name, _, attr = target.partition(":")
    if not attr:
        raise ConfigError(f"unknown task {name!r}: use one of {sorted(REGISTRY)} or 'module:ClassName'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load task {name!r} ({e}); is the plugin installed?") from e


def build_task(config, files: Optional[Dict[str, Path]] = None, data_seed: int = 0):
    """The run's task, with its files and this peer's data order for built-in ones."""
    cls = load_task_class(config.task)
    if config.task in REGISTRY:
        return cls(config.task_options, config.seed, files=files, data_seed=data_seed)
    return cls(config.task_options, config.seed)
