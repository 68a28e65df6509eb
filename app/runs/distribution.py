"""What a volunteer downloads from the portal: the wheels built with this package (dedloc-common and
dedloc-worker, see setup.py) and a join notebook."""

from __future__ import annotations

import json
from pathlib import Path

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
