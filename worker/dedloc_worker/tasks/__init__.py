"""Task plugins: what a run trains.

A task is a class built as ``Task(options: dict, seed: int)`` with a ``model`` (``torch.nn.Module``) and a
``batch_loss(batch_size) -> torch.Tensor`` method that draws ``batch_size`` samples from the worker's own data
stream and returns their mean loss. A run names its task by a registered name or by ``"module:attr"``.
"""

from __future__ import annotations

import importlib

from ..errors import ConfigError

REGISTRY = {
    "tiny-lm": "dedloc_worker.tasks.tiny_lm:TinyLanguageModel",
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
