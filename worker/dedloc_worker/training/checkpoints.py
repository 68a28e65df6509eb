"""The checkpoint archive: what the checkpointer writes and what a worker resumes from.

A tar of the task's Hugging Face files (config.json, model.safetensors, tokenizer files: they load with
``from_pretrained`` after extraction) plus ``training_state.pt``, what resuming needs beyond the model: every
parameter in the optimizer's order, the optimizer's and the scheduler's state and the epoch; and ``dedloc.json``
(run, task, epoch, samples, evaluation loss)."""

from __future__ import annotations

import hashlib
import json
import tarfile
import tempfile
from pathlib import Path
from typing import Optional

import torch

STATE_FILE = "training_state.pt"
META_FILE = "dedloc.json"


def write_archive(target: Path, task, parameters, optimizer_state: dict, scheduler_state: Optional[dict],
                  meta: dict, outer: Optional[dict] = None) -> str:
    """Write the archive to ``target`` (atomically) and return its sha256. ``outer``: a local-updates run's outer
    optimizer state (``momentum``, one tensor per parameter, and ``rounds``); ``parameters`` are then the outer ones."""
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        folder = Path(scratch) / "checkpoint"
        folder.mkdir()
        task.save(folder)
        state = {"epoch": int(meta["epoch"]), "parameters": [p.detach().cpu() for p in parameters],
                 "optimizer": optimizer_state, "scheduler": scheduler_state}
        if outer is not None:
            state["outer"] = outer
        torch.save(state, folder / STATE_FILE)
        (folder / META_FILE).write_text(json.dumps(meta, indent=1))
        partial = Path(scratch) / "archive.tar"
        with tarfile.open(partial, "w") as tar:
            for path in sorted(folder.iterdir()):
                tar.add(path, arcname=path.name)
        partial.replace(target)
    return sha256_of(target)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def extract(archive: Path, folder: Path) -> Path:
    """Unpack an archive (plain files only: no links, no paths outside ``folder``)."""
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    return folder


def read_state(folder: Path) -> dict:
    """The training state of an extracted checkpoint (tensors and numbers only: ``weights_only``)."""
    return torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
