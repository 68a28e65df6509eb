"""``dedloc-worker join --devices``: one join process per GPU, each its own peer, all signed in as one account.

The parent signs in once and hands the credential to every child in its environment. Each child is shown one GPU
(``CUDA_VISIBLE_DEVICES``), so it trains as a single-GPU worker does, with its own key and peer token, and its
lines come out prefixed with its GPU. A stop reaches every child; each leaves the swarm, and what is left of its
process group is ended.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional, Sequence, TextIO

from dedloc_worker.errors import RUN_FINISHED, ConfigError

# Past a child's own STUCK_SECONDS (cli.py, 25 s), so a stuck child prints where its threads are before it is ended.
LEAVE_SECONDS = 30.0


@dataclass(frozen=True)
class Child:
    """One GPU's process: ``label`` prefixes its lines ("gpu 1"); ``env`` is its whole environment."""

    label: str
    argv: list[str]
    env: dict[str, str]


def join_on_gpus(args, stop: threading.Event) -> int:
    """Sign in once, then train on every GPU ``args.devices`` names until ``stop``; returns the exit code."""
    from dedloc_worker.portal.client import fetch_join_info
    from dedloc_worker.session import CREDENTIAL_ENV, ended, obtain_credential
    from dedloc_worker.training.device import gpus, physical_cores

    refuse_conflicts(args)
    indices = gpus(args.devices)
    ended(fetch_join_info(args.portal, args.run).config)  # an unknown or ended run is one line, before any login
    credential = obtain_credential(args.portal)  # before the children start: one login, never one per GPU
    threads = args.threads or max(1, physical_cores() // len(indices))
    names = [visible_name(index, os.environ.get("CUDA_VISIBLE_DEVICES")) for index in indices]
    children = [Child(f"gpu {gpu}", child_argv(args, position, gpu, threads),
                      {**os.environ, CREDENTIAL_ENV: credential, "CUDA_VISIBLE_DEVICES": gpu, "PYTHONUNBUFFERED": "1"})
                for position, gpu in enumerate(names)]
    if stop.is_set():  # Ctrl-C during the login
        return 0
    print(f"training on GPU{'s' if len(names) > 1 else ''} {', '.join(names)}: a peer each, all credited to the "
          "account this machine signed in as; Ctrl-C leaves with all of them", flush=True)
    return run_children(children, stop)


def refuse_conflicts(args) -> None:
    if args.device == "cpu":
        raise ConfigError("--devices trains on GPUs and --device cpu on the CPU: give one of them")
    if args.aux:
        raise ConfigError("--aux trains nothing, so it uses no GPU: leave out --devices")


def visible_name(index: int, visible: Optional[str]) -> str:
    """How a child names GPU ``index`` of this process in its ``CUDA_VISIBLE_DEVICES``: where this process was
    itself given a list, torch's index ``index`` is that list's entry."""
    entries = [entry.strip() for entry in visible.split(",")] if visible else []
    return entries[index] if index < len(entries) else str(index)


def child_argv(args, position: int, gpu: str, threads: int) -> list[str]:
    """The ``join`` command line of the ``position``-th GPU's process: the parent's options on that GPU, each
    with a listening port, report and state file of its own."""
    argv = [sys.executable, "-m", "dedloc_worker", "join", args.portal, "--run", args.run,
            "--listen", own_port(args.listen, position), "--wait", str(args.wait), "--device", "cuda",
            "--threads", str(threads)]
    if args.client is not None:
        argv.append("--client" if args.client else "--no-client")
    if args.max_epochs is not None:
        argv += ["--max-epochs", str(args.max_epochs)]
    if args.report:
        argv += ["--report", str(own_file(args.report, gpu))]
    if args.state_out:
        argv += ["--state-out", str(own_file(args.state_out, gpu))]
    if args.verbose:
        argv.append("--verbose")
    return argv


def own_port(listen: str, position: int) -> str:
    """A fixed port counts up from the one given, a port a process each; port 0 (any free port) stays 0."""
    return re.sub(r"/(tcp|udp)/([1-9][0-9]*)", lambda m: f"/{m[1]}/{int(m[2]) + position}", listen)


def own_file(path: Path, gpu: str) -> Path:
    return path.with_name(f"{path.stem}.gpu{gpu}{path.suffix}")


def run_children(children: Sequence[Child], stop: threading.Event, out: Optional[TextIO] = None,
                 err: Optional[TextIO] = None, grace: float = LEAVE_SECONDS) -> int:
    """Run ``children`` until every one has exited or ``stop`` is set, their lines prefixed "[label] " on ``out``
    and ``err`` (this process's stdout and stderr by default); then ask those still running to leave (SIGTERM),
    wait up to ``grace`` seconds, and end what is left of each one's process group.

    Returns the first failure's exit code in ``children``'s order, else ``RUN_FINISHED`` where one saw the run end,
    else 0.
    """
    out, err, lock = out or sys.stdout, err or sys.stderr, threading.Lock()
    started: list[tuple[subprocess.Popen, Child, list[threading.Thread]]] = []
    try:
        for child in children:
            # A group of its own, as app/core/processes.py gives its children: hivemind's processes outlive a
            # parent that dies, and a group is how they are found and ended.
            process = subprocess.Popen(child.argv, env=child.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, start_new_session=True)
            relays = [threading.Thread(target=relay_lines, args=(pipe, f"[{child.label}] ", stream, lock), daemon=True)
                      for pipe, stream in ((process.stdout, out), (process.stderr, err))]
            for relay in relays:
                relay.start()
            started.append((process, child, relays))
        watch(started, stop, err, lock)
    finally:
        leave([process for process, _, _ in started], grace)
        for _, _, relays in started:
            for relay in relays:
                relay.join(timeout=2.0)
    # A child that a stop's SIGTERM reached before it could handle it (still starting) did not fail.
    codes = [0 if stop.is_set() and process.returncode == -signal.SIGTERM else process.returncode
             for process, _, _ in started]
    return exit_code(codes)


def watch(started, stop: threading.Event, err: TextIO, lock: threading.Lock) -> None:
    """Wait for ``stop`` or every child's exit; one line for a child that failed while the others train on."""
    running = list(started)
    while running and not stop.wait(0.2):
        for entry in [entry for entry in running if entry[0].poll() is not None]:
            running.remove(entry)
            process, child, relays = entry
            if running and process.returncode not in (0, RUN_FINISHED):
                for relay in relays:  # its own last lines (its error) first
                    relay.join(timeout=2.0)
                say(err, lock, f"[{child.label}] stopped (exit code {process.returncode}); the other GPUs train on")


def leave(processes: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every child still running, wait up to ``grace`` seconds, then SIGKILL each one's process group
    (hivemind processes a stuck or crashed child left behind, or the child itself)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # each leaves the swarm as on Ctrl-C
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        end_group(process.pid)
        process.wait()


def end_group(pgid: int, timeout: float = 5.0) -> None:
    from dedloc_common.cleanup import live_processes

    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return  # nothing of it is left
    deadline = time.monotonic() + timeout
    while any(found.group == pgid for found in live_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)


def relay_lines(pipe: IO[bytes], prefix: str, stream: TextIO, lock: threading.Lock) -> None:
    with pipe:
        for line in iter(pipe.readline, b""):
            say(stream, lock, prefix + line.decode(errors="replace").rstrip("\r\n"))


def say(stream: TextIO, lock: threading.Lock, line: str) -> None:
    with lock:  # whole lines: two children never share one
        stream.write(line + "\n")
        stream.flush()


def exit_code(codes: Sequence[int]) -> int:
    """The first failure (a child killed by a signal: 1), else ``RUN_FINISHED`` where one saw the run end, else 0."""
    failure = next((code for code in codes if code not in (0, RUN_FINISHED)), None)
    if failure is not None:
        return failure if failure > 0 else 1
    return RUN_FINISHED if RUN_FINISHED in codes else 0
