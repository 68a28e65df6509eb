"""The ``dedloc-worker`` command. Errors end as one line on stderr and an exit code (see ``errors.py``)."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
from pathlib import Path

from dedloc_worker.errors import WorkerError

STUCK_SECONDS = 25.0  # after Ctrl-C or SIGTERM: a leave takes a few seconds (LEAVE_GRACE, a state round's rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dedloc-worker", description="Train a dedloc run with your machine.")
    commands = parser.add_subparsers(dest="command", required=True)
    login = commands.add_parser("login", help="sign this machine in to a portal (approve a code in your browser)")
    login.add_argument("portal", help="the portal's address")
    logout = commands.add_parser("logout", help="revoke this machine's sign-in on a portal and forget it")
    logout.add_argument("portal", help="the portal's address")
    join = commands.add_parser("join", help="join a run and train until stopped (Ctrl-C leaves cleanly)")
    join.add_argument("portal", help="the portal's address, e.g. https://dedloc.example.org")
    join.add_argument("--run", required=True, help="the run's slug, as shown on its join page")
    join.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0",
                      help="multiaddr to accept peers on (with --devices, a fixed port counts up, one per GPU)")
    role = join.add_mutually_exclusive_group()
    # None (the default): decided at join by the portal's dial-back; --client / --no-client force it.
    role.add_argument("--client", action=argparse.BooleanOptionalAction, default=None,
                      help="accept no incoming connections (--client) or insist on accepting them (--no-client); "
                           "by default the portal dials this machine back at join and decides")
    role.add_argument("--aux", action="store_true",
                      help="auxiliary peer: train nothing, only aggregate (a CPU machine with a good link)")
    join.add_argument("--max-epochs", type=int, help="leave once the collaboration reaches this epoch")
    join.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the run's coordinator")
    join.add_argument("--report", type=Path, help="write this worker's contributions here as JSON on exit "
                      "(with --devices, one file per GPU: NAME.gpuN.json)")
    join.add_argument("--state-out", type=Path, help="write the final model parameters here (torch.save) on exit "
                      "(with --devices, one file per GPU)")
    join.add_argument("--verbose", action="store_true",
                      help="show hivemind's own messages in full (tracebacks of expected events included)")
    join.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                      help="where to train: a CUDA GPU when there is one (auto), or force one")
    join.add_argument("--devices", metavar="all|0,2,...",
                      help="train on several GPUs of this machine: every one (all) or those listed, a process and a "
                           "peer each, all credited to your account")
    join.add_argument("--threads", type=int, help="CPU threads for torch (default: this machine's physical cores, "
                      "shared out among --devices' GPUs)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    stop = threading.Event()

    def leave(*_) -> None:
        # A --devices parent only waits for its GPUs' processes, and those print their own threads when stuck.
        if not stop.is_set() and getattr(args, "devices", None) is None:
            # A worker leaves within seconds; one still here after STUCK_SECONDS prints where each thread is (from a
            # C thread of faulthandler's, which a stuck main thread does not hold up), for a bug report
            faulthandler.dump_traceback_later(STUCK_SECONDS, exit=False)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, leave)
    try:
        code = COMMANDS[args.command](args, stop)
    except WorkerError as e:
        print(f"dedloc-worker: {e}", file=sys.stderr)
        code = e.exit_code
    # Everything is shut down and written by now. A normal interpreter exit can still abort in torch's C++
    # teardown once hivemind's processes are gone ("terminate called after throwing std::system_error").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_and_report(args, stop: threading.Event) -> int:
    from dedloc_worker.errors import RUN_FINISHED
    from dedloc_worker.session import run_join

    if args.devices is not None:
        from dedloc_worker.launcher import join_on_gpus

        return join_on_gpus(args, stop)
    result = run_join(args, stop)
    write_outputs(args, result)
    print(f"left the swarm at epoch {result.final_epoch}; "
          f"contributed {sum(c.samples for c in result.contributions)} samples", flush=True)
    if result.finished:
        print(f"run {args.run!r} is finished: thank you! Its final model is on the run's page", flush=True)
        return RUN_FINISHED
    return 0


def run_login(args, stop) -> int:
    from dedloc_worker.portal.login import device_login, save_credential

    credential = device_login(args.portal)
    path = save_credential(credential)
    print(f"signed in to {args.portal} as {credential.username}; credential saved in {path}")
    return 0


def run_logout(args, stop) -> int:
    from dedloc_worker.portal.login import forget_credential, load_credential, revoke_on_portal

    credential = load_credential(args.portal)
    if credential is None:
        print(f"this machine was not signed in to {args.portal}")
        return 0
    failure = revoke_on_portal(credential)
    forget_credential(args.portal)  # a credential the portal still honours is still gone from this machine
    if failure is None:
        print(f"signed out of {args.portal}: the portal revoked this machine's credential and it is forgotten here")
        return 0
    print(f"forgot this machine's sign-in to {args.portal}, but could not revoke it there ({failure}); "
          f"revoke it on {credential.portal_url}/me#machines")
    return 1


COMMANDS = {"join": run_and_report, "login": run_login, "logout": run_logout}


def write_outputs(args, result) -> None:
    if args.report:
        report = {
            "username": result.username,
            "peer_id": result.peer_id,
            "final_epoch": result.final_epoch,
            "contributions": [c.dict() for c in result.contributions],
            "link": result.link.dict() if result.link is not None else None,
        }
        args.report.write_text(json.dumps(report, indent=1))
    if args.state_out:
        import torch

        torch.save(result.state, args.state_out)
