"""``dedloc demo``: portal, coordinator and local workers on loopback, until Ctrl-C ends them all.

Its run is the paper's sahajBERT scaled to a CPU: a small ALBERT masked-LM, a tokenizer the portal trains on the
run's text at creation, LAMB, checkpoints every few epochs with an evaluation loss on held-out text. The text is
Python's own documentation (``pydoc_data.topics``), which every Python ships, so the demo runs offline."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
from dedloc_common.contract import LOOPBACK_OPTIMIZER
from dedloc_worker.session import CREDENTIAL_ENV

from app.core.config import Settings
from app.core.errors import DedlocError
from app.core.processes import spawn, stop_all

DEMO_RUN = "demo"
VOLUNTEERS = ["alice", "bob", "carol", "dave"]
# About 0.4 M parameters, ~200 samples/s per CPU thread: 2 workers take a step of 512 samples every few seconds;
# a checkpoint every 10 steps (under a minute). Shorter steps spent more of the time forming averaging groups.
DEMO_MODEL = {"model_type": "albert", "embedding_size": 64, "hidden_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 256, "max_position_embeddings": 128}
DEMO_TASK = {"model": DEMO_MODEL, "data": {"files": ["train.txt"], "eval_files": ["eval.txt"]},
             "tokenizer": {"train": {"vocab_size": 4000}}, "sequence_length": 64, "eval_samples": 128}
DEMO_OPTIMIZER = {**LOOPBACK_OPTIMIZER, "name": "lamb", "lr": 0.01, "weight_decay": 0.01, "clip_grad_norm": 1.0}
DEMO_CHECKPOINTS = {"every_epochs": 10, "keep": 3}
HELD_OUT = 0.1  # the last tenth of the documentation's topics (by name) is the evaluation text


def write_corpus(folder: Path) -> tuple[Path, Path]:
    """Python's documentation as training and held-out text, one paragraph per line."""
    from pydoc_data.topics import topics

    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(topics)
    cut = int(len(names) * (1 - HELD_OUT))
    paths = []
    for part, file in ((names[:cut], "train.txt"), (names[cut:], "eval.txt")):
        paragraphs = (" ".join(p.split()) for name in part for p in topics[name].split("\n\n"))
        (folder / file).write_text("\n".join(p for p in paragraphs if p) + "\n")
        paths.append(folder / file)
    return paths[0], paths[1]


def create_command(py: str, folder: Path) -> list[str]:
    train, held_out = write_corpus(folder)
    return [py, "-m", "app.cli", "create-run", DEMO_RUN, "--title", "Demo: a small ALBERT learns Python's docs",
            "--task", "masked-lm", "--task-options", json.dumps(DEMO_TASK), "--file", str(train),
            "--file", str(held_out), "--target-batch-size", "512", "--batch-size", "16",
            "--optimizer", json.dumps(DEMO_OPTIMIZER), "--checkpoints", json.dumps(DEMO_CHECKPOINTS), "--if-missing"]


def check_alive(started) -> None:
    if any(proc.poll() is not None for proc in started):
        raise DedlocError("a demo process exited unexpectedly; see its messages above")


def wait_until(check, timeout: float, what: str, started, done: threading.Event) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done.is_set():
        check_alive(started)
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        done.wait(0.3)
    if not done.is_set():
        raise DedlocError(f"{what} did not come up within {timeout:.0f} s; see the messages above")


def issue_credentials(settings: Settings, usernames: list[str]) -> dict[str, str]:
    """Worker credentials for the local volunteers, as an operator issues one for a headless machine
    (``dedloc issue-credential``)."""
    from app.core.database import one_session
    from app.identity.accounts import issue_headless_credential

    with one_session(settings.resolved_database_url, migrate_first=False) as session:
        return {name: issue_headless_credential(session, name) for name in usernames}


def port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex((host, port)) != 0


def run_demo(settings: Settings, workers: int) -> None:
    if not port_free(settings.host, settings.port):
        raise DedlocError(f"port {settings.port} on {settings.host} is taken; stop what uses it or set DEDLOC_PORT")
    url = f"http://{settings.host}:{settings.port}"
    py = sys.executable
    started = []
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    try:
        create = spawn(create_command(py, Path(settings.data_dir) / "demo-corpus"))
        if create.wait() != 0:
            raise DedlocError("could not create the demo run")
        started.append(spawn([py, "-m", "app.cli", "serve"]))
        started.append(spawn([py, "-m", "app.cli", "coordinator", "--run", DEMO_RUN]))
        wait_until(lambda: httpx.get(f"{url}/api/v1/runs/{DEMO_RUN}/join").json()["initial_peers"], 60,
                   "the portal and the coordinator", started, done)
        print(f"\n  dedloc demo is running: open {url}/runs/{DEMO_RUN}\n  Ctrl-C stops everything.\n", flush=True)
        credentials = issue_credentials(settings, VOLUNTEERS[:workers])
        for index, name in enumerate(VOLUNTEERS[:workers] if not done.is_set() else []):
            # One thread each: the local workers share this machine's cores with the portal and the coordinator.
            started.append(spawn([py, "-m", "dedloc_worker", "join", url, "--run", DEMO_RUN, "--threads", "1",
                                  "--listen", "/ip4/127.0.0.1/tcp/0"], env={CREDENTIAL_ENV: credentials[name]}))
            # One founder; the others start once it trains, and find it (docs/hivemind.md#state-checkpoints-and-resume).
            if index == 0:
                wait_until(lambda: httpx.get(f"{url}/api/v1/runs/{DEMO_RUN}/swarm").json()["peers_online"] >= 1,
                           120, "the first worker's training", started, done)
        while not done.wait(1.0):
            check_alive(started)
    finally:
        print("stopping the demo...", flush=True)
        # Workers leave together first (each hands its last round over), then the coordinator and the portal.
        stop_all(started[2:])
        stop_all(started[:2])
        print("demo stopped; nothing left running", flush=True)
