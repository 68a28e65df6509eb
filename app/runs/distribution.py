"""What a volunteer downloads from the portal: the wheels built with this package (dedloc-common and
dedloc-worker, see setup.py) and a join notebook."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.core.errors import DedlocError, NotFound
from app.core.resources import wheels_dir

DISTRIBUTIONS = ("dedloc_common", "dedloc_worker")  # dependency first: pip reads the line left to right


def wheels() -> list[Path]:
    """This portal's volunteer wheels, one per distribution."""
    found = {path.name.split("-", 1)[0]: path for path in sorted(wheels_dir().glob("*.whl"))} \
        if wheels_dir().is_dir() else {}
    missing = [name for name in DISTRIBUTIONS if name not in found]
    if missing:
        raise DedlocError(f"this portal was installed without the volunteer wheels ({', '.join(missing)}): install "
                          "it from a full source tree (pip install .), or run make setup in a checkout")
    return [found[name] for name in DISTRIBUTIONS]


def wheel(filename: str) -> Path:
    served = {path.name: path for path in wheels()}
    if filename not in served:
        raise NotFound(f"no download named {filename!r}; this portal serves {', '.join(served)}")
    return served[filename]


def install_line(portal_url: str) -> str:
    base = f"{portal_url.rstrip('/')}/downloads"
    return "pip install " + " ".join(f"{base}/{path.name}" for path in wheels())


def join_line(portal_url: str, slug: str) -> str:
    return f"dedloc-worker join {portal_url.rstrip('/')} --run {slug}"


def join_notebook(portal_url: str, slug: str, title: str) -> dict:
    """A Jupyter notebook (Colab, Kaggle) that installs the worker and joins the run. Its metadata asks both for a
    GPU; the worker trains on it by itself (``--device auto``), and decides by itself whether the machine can be
    reached (these platforms accept no connections: it becomes a client, credited the same)."""
    def cell(kind: str, source: str) -> dict:
        extra: dict[str, Any] = {"execution_count": None, "outputs": []} if kind == "code" else {}
        return {"cell_type": kind, "metadata": {}, "source": source, **extra}

    gpu_check = ("import shutil, subprocess\n"
                 "if shutil.which('nvidia-smi'):\n"
                 "    print(subprocess.run(['nvidia-smi', '-L'], capture_output=True, text=True).stdout)\n"
                 "else:\n"
                 "    print('No GPU: the worker will train on the CPU, slowly. '\n"
                 "          'Colab: Runtime > Change runtime type > '\n"
                 "          'GPU. Kaggle: Settings > Accelerator > GPU.')")
    return {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}, "accelerator": "GPU",
                     "colab": {"gpuType": "T4", "provenance": []},
                     "kaggle": {"accelerator": "gpu", "isGpuEnabled": True, "isInternetEnabled": True}},
        "cells": [
            cell("markdown", f"# Join {title}\n\nRun the cells in order. The last prints a short code and a link: "
                             "open the link, sign in, and approve the code. The worker trains on this machine's GPU "
                             "and finds out by itself that nobody can connect to it here (it then sends its "
                             "gradients without aggregating, credited the same). Stop the cell to leave the run."),
            cell("code", gpu_check),
            # The worker wheel brings what every built-in task needs (transformers, datasets, tokenizers...).
            cell("code", f"!{install_line(portal_url)}"),
            cell("code", f"!{join_line(portal_url, slug)} --device auto"),
        ],
    }


def notebook_bytes(portal_url: str, slug: str, title: str) -> bytes:
    return json.dumps(join_notebook(portal_url, slug, title), indent=1).encode()
