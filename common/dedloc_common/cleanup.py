"""Ending every process this one started, however deep.

hivemind's DHT, averagers and p2pd daemon are children (and grandchildren) of the process that created them, and
some survive their ``shutdown()`` (a DHT child stuck on a pipe, a daemon-mode process the parent never joins).
Whoever started them ends them: ``end_descendants`` runs last, as the worker or coordinator exits.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    parent: int
    group: int


def live_processes() -> list[ProcessInfo]:
    """Every process on this machine that is not a zombie, read from /proc (empty where there is none)."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else []:
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            found.append(ProcessInfo(int(entry.name), int(fields[1]), int(fields[2])))
    return found


def _children_by_parent() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for process in live_processes():
        tree.setdefault(process.parent, []).append(process.pid)
    return tree


def descendants(pid: int | None = None) -> list[int]:
    """Live descendants of ``pid`` (default: this process), children first. Linux only; empty elsewhere."""
    tree, found, frontier = _children_by_parent(), [], [pid or os.getpid()]
    while frontier:
        children = [child for parent in frontier for child in tree.get(parent, [])]
        found.extend(children)
        frontier = children
    return found


def _is_torch_shm_manager(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"torch_shm_manager")
    except OSError:
        return False


def end_descendants(grace: float = 2.0) -> None:
    """SIGTERM every descendant, then SIGKILL whatever is left after ``grace`` seconds.

    torch's shared-memory manager is spared: killing it aborts this process, and it exits by itself once its
    last client is gone.
    """
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        pids = [pid for pid in descendants() if not _is_torch_shm_manager(pid)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False
