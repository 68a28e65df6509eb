"""The ``dedloc-worker`` command. Errors end as one line on stderr and an exit code (see ``errors.py``)."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .errors import SwarmError, WorkerError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dedloc-worker", description="Train a dedloc run with your machine.")
    commands = parser.add_subparsers(dest="command", required=True)
    join = commands.add_parser("join", help="join a run and train until stopped (Ctrl-C leaves cleanly)")
    join.add_argument("portal", help="the portal's address, e.g. https://dedloc.example.org")
    join.add_argument("--run", required=True, help="the run's slug, as shown on its join page")
    join.add_argument("--username", default=getpass.getuser(), help="name credited on the leaderboard (demo identity)")
    join.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0", help="multiaddr to accept peers on")
    join.add_argument("--client", action="store_true", help="behind NAT: do not accept incoming connections")
    join.add_argument("--max-epochs", type=int, help="leave once the collaboration reaches this epoch")
    join.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the run's coordinator")
    join.add_argument("--report", type=Path, help="write this worker's contributions here as JSON on exit")
    join.add_argument("--state-out", type=Path, help="write the final model parameters here (torch.save) on exit")
    join.add_argument("--threads", type=int, default=1, help="CPU threads for torch")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        code = run_join(args, stop)
    except WorkerError as e:
        print(f"dedloc-worker: {e}", file=sys.stderr)
        code = e.exit_code
    # Everything is shut down and written by now. A normal interpreter exit can still abort in torch's C++
    # teardown once hivemind's processes are gone ("terminate called after throwing std::system_error").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_join(args, stop: threading.Event) -> int:
    # Heavy imports here, after the command line is known to be valid: `--help` stays instant.
    import torch

    from .cleanup import end_descendants
    from .portal import wait_for_peers
    from .progress import ProgressDisplay
    from .tasks import load_task_class
    from .trainer import train

    torch.set_num_threads(args.threads)
    deadline = time.monotonic() + args.wait
    info = wait_for_peers(args.portal, args.run, args.wait)
    config = info.config
    task = load_task_class(config.task)(config.task_options, config.seed)
    print(f"joining run {config.slug!r} as {args.username}: task {config.task}, "
          f"global batch {config.target_batch_size} samples", flush=True)
    try:
        dht = join_swarm(args, info, deadline)
        try:
            with ProgressDisplay() as display:
                result = train(dht, config, task, args.username, stop, args.max_epochs, args.client, display.update)
        finally:
            dht.shutdown()
    finally:
        end_descendants()
    write_outputs(args, result)
    print(f"left the swarm at epoch {result.final_epoch}; "
          f"contributed {sum(c.samples for c in result.contributions)} samples", flush=True)
    return 0


def join_swarm(args, info, deadline: float):
    """Start the DHT node; while the run's peers are unreachable (a coordinator restarting), ask the portal
    again until ``deadline``."""
    from hivemind.p2p import P2PDaemonError

    from .portal import wait_for_peers
    from .swarm import create_dht

    while True:
        try:
            return create_dht(info.initial_peers, args.listen, args.client)
        except P2PDaemonError as e:
            if time.monotonic() > deadline:
                raise SwarmError(f"cannot reach any peer of run {args.run!r} ({e}); retry in a minute") from None
            print("the run's coordinator is unreachable; asking the portal again...", flush=True)
            time.sleep(2.0)
            info = wait_for_peers(args.portal, args.run, max(deadline - time.monotonic(), 1.0))


def write_outputs(args, result) -> None:
    if args.report:
        report = {
            "username": args.username,
            "final_epoch": result.final_epoch,
            "contributions": [c.dict() for c in result.contributions],
        }
        args.report.write_text(json.dumps(report, indent=1))
    if args.state_out:
        import torch

        torch.save(result.state, args.state_out)
