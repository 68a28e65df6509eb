"""The project's benchmarks (`make bench`); each writes its results under bench/results (docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(out: Path, results, table: str) -> None:
    """``results`` as JSON in ``out`` and ``table`` (Markdown) beside it, then say where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
