"""Starting and ending child processes together with everything they spawn.

hivemind leaves its DHT, averager and p2pd processes alive when their parent dies, so every process we start
gets a process group of its own (``start_new_session``) and is ended as a group: first a polite signal to the
leader (so a worker can leave the swarm cleanly), then SIGKILL to whatever of the group is still there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from dedloc_common.cleanup import live_processes


def spawn(args: Sequence[str], log: Path | None = None, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """Start ``args`` as the leader of a new process group; output to ``log`` (appended) or inherited."""
    out = open(log, "ab") if log else None
    try:
        return subprocess.Popen(
            list(args), start_new_session=True, stdout=out, stderr=subprocess.STDOUT if out else None,
            env={**os.environ, **(env or {})}, **kwargs,
        )
    finally:
        if out:
            out.close()


def tagged_processes(variable: str, value: str) -> list[int]:
    """Live (non-zombie) processes, other than this one, whose environment carries ``variable=value``: all that
    a command started, whichever process group each moved to (children inherit the environment)."""
    needle = f"{variable}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            alive = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            if alive and needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of group ``pgid``."""
    return [process.pid for process in live_processes() if process.group == pgid]


def stop(proc: subprocess.Popen, grace: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
    """End ``proc`` and its whole process group; returns the leader's exit code (None if it had to be killed)."""
    code = proc.poll()
    if code is None:
        try:
            proc.send_signal(sig)
            code = proc.wait(grace)
        except subprocess.TimeoutExpired:
            code = None
    kill_group(proc.pid)
    if code is None:
        proc.wait(5)
    return code


def stop_all(procs: Sequence[subprocess.Popen], grace: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """End several processes at once: one signal to every leader, one shared ``grace``, then their groups."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    deadline = time.monotonic() + grace
    for proc in procs:
        stop(proc, grace=max(deadline - time.monotonic(), 0.1), sig=sig)


def kill_group(pgid: int, timeout: float = 5.0) -> None:
    """SIGKILL every member of the group and wait until none is left."""
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {group_members(pgid)} of group {pgid} survived SIGKILL")
        time.sleep(0.05)
