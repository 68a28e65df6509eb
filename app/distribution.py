"""What a volunteer downloads from the portal: the worker wheel (built from worker/) and a join notebook."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

from .db import ROOT
from .errors import DedlocError

WORKER_SOURCE = ROOT / "worker"
_build_lock = threading.Lock()


def worker_version() -> str:
    text = (WORKER_SOURCE / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.MULTILINE).group(1)


def wheel_name() -> str:
    return f"dedloc_worker-{worker_version()}-py3-none-any.whl"


def worker_wheel(data_dir: Path) -> Path:
    """The worker wheel of this portal's version, built once into ``data_dir/wheels`` (a few seconds)."""
    target = Path(data_dir).resolve() / "wheels"
    wheel = target / wheel_name()
    with _build_lock:
        if not wheel.exists():
            target.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(target),
                 str(WORKER_SOURCE)], capture_output=True, text=True, timeout=300,
            )
            if done.returncode != 0 or not wheel.exists():
                raise DedlocError(f"the worker wheel could not be built: {done.stderr.strip()[-300:]}")
    return wheel


def install_line(portal_url: str) -> str:
    return f"pip install {portal_url.rstrip('/')}/downloads/{wheel_name()}"


def join_line(portal_url: str, slug: str) -> str:
    return f"dedloc-worker join {portal_url.rstrip('/')} --run {slug}"


def join_notebook(portal_url: str, slug: str, title: str) -> dict:
    """A Jupyter notebook (Colab, Kaggle) that installs the worker and joins the run."""
    def cell(kind: str, source: str) -> dict:
        extra = {"execution_count": None, "outputs": []} if kind == "code" else {}
        return {"cell_type": kind, "metadata": {}, "source": source, **extra}

    return {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}, "accelerator": "GPU"},
        "cells": [
            cell("markdown", f"# Join {title}\n\nRun both cells. The second prints a short code and a link: open "
                             "the link, sign in, and approve the code. Stop the cell to leave the run."),
            cell("code", f"!{install_line(portal_url)}"),
            cell("code", f"!{join_line(portal_url, slug)}"),
        ],
    }


def notebook_bytes(portal_url: str, slug: str, title: str) -> bytes:
    return json.dumps(join_notebook(portal_url, slug, title), indent=1).encode()
