"""What a run trains: the built-in tasks and plugins.

A task has a ``model`` (``torch.nn.Module``) and ``batch_loss(batch_size) -> torch.Tensor``, the mean loss of
``batch_size`` samples from the worker's own data stream. Built-in tasks also have ``to(device, amp)``,
``evaluate()`` (held-out loss or None) and ``save(folder)`` (Hugging Face format). A run names a built-in task
(``dedloc_common.tasks.BUILT_IN``) or a plugin by ``"module:attr"``, built as ``Task(options, seed)``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Dict, Optional

from ..errors import ConfigError

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
