"""The ``dedloc`` command for operators and organizers: migrate, create-run, serve, coordinator,
coordinator-health, portal-health, demo, export-stats, ban, unban, set-ceiling.

Errors end as one line on stderr and the exit code of the error class (``errors.py``).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from app.core.config import Settings
from app.core.errors import DedlocError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dedloc", description="dedloc portal and coordinator")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("migrate", help="bring the database schema to the newest version")

    create = commands.add_parser("create-run", help="create a training run")
    create.add_argument("slug", help="short name used in URLs, e.g. sahajbert")
    create.add_argument("--title", help="human title (default: the slug)")
    create.add_argument("--task", default="tiny-lm", help="task plugin name or module:Class")
    create.add_argument("--target-batch-size", type=int, default=4096,
                        help="samples per collaboration step (the swarm averages once a step: pick one the swarm "
                             "takes ten seconds or more to fill)")
    create.add_argument("--batch-size", type=int, default=16, help="samples per local mini-step")
    create.add_argument("--task-options", type=json.loads, default={}, help="JSON object of task options")
    create.add_argument("--samples-per-second-ceiling", type=float, default=None,
                        help="claims above this per peer are held, not credited (default: derived from the swarm's "
                             "confirmed rates, docs/averaging.md#ceiling)")
    create.add_argument("--optimizer", type=json.loads, default={}, help="JSON object of optimizer options")
    create.add_argument("--file", type=Path, action="append", default=[], dest="files",
                        help="a data file the task options name (repeat for several); served to the run's workers")
    target = create.add_mutually_exclusive_group()
    target.add_argument("--target-epochs", type=int, help="end the run after this many optimizer steps")
    target.add_argument("--target-samples", type=int,
                        help="or after this many samples (rounded up to whole steps of --target-batch-size)")
    create.add_argument("--checkpoints", type=json.loads, default={},
                        help='JSON object: {"every_epochs": 10, "every_minutes": null, "keep": 3, "hub_repo": null}')
    create.add_argument("--if-missing", action="store_true", help="succeed quietly when the run exists")

    credential = commands.add_parser("issue-credential",
                                     help="print a worker API credential for USERNAME (headless machines, demo)")
    credential.add_argument("username")

    for verb in ("ban", "unban"):
        ban = commands.add_parser(verb, help=f"{verb} a user from a run (reaches running peers within a minute)")
        ban.add_argument("slug")
        ban.add_argument("username")
        if verb == "ban":
            ban.add_argument("--reason", default="", help="shown to the user")

    ceiling = commands.add_parser("set-ceiling", help="set a run's plausible samples per second per peer; claims "
                                                      "held now are re-decided under it")
    ceiling.add_argument("slug")
    ceiling.add_argument("samples_per_second", type=float)

    export = commands.add_parser("export-stats", help="write the public stats dumps (users and teams, JSON and "
                                                      "CSV, gzip); the portal serves DATA_DIR/stats under /stats/")
    export.add_argument("--out", type=Path, help="folder to write to (default: DEDLOC_DATA_DIR/stats)")

    serve = commands.add_parser("serve", help="run the web portal")
    serve.add_argument("--host", help="bind address (default from DEDLOC_HOST)")
    serve.add_argument("--port", type=int, help="port (default from DEDLOC_PORT)")
    serve.add_argument("--workers", type=int, help="web processes on the one port (default from "
                                                   "DEDLOC_WEB_PROCESSES, 1); they share everything through the "
                                                   "database and DEDLOC_DATA_DIR")

    coordinator = commands.add_parser("coordinator", help="run a run's coordinator (bootstrap peer and monitor)")
    coordinator.add_argument("--run", required=True, help="the run's slug")
    coordinator.add_argument("--listen", help="multiaddr to listen on (default: as last time, else a free port)")
    coordinator.add_argument("--announce", action="append", metavar="MULTIADDR",
                             help="address peers reach this coordinator at, e.g. /dns4/swarm.example.org/tcp/31337 "
                                  "(repeat for several; default from DEDLOC_ANNOUNCE_MADDRS): announced to the swarm "
                                  "and offered to joining workers instead of the addresses it listens on; needs "
                                  "--listen with a fixed port")
    coordinator.add_argument("--verbose", action="store_true", help="show hivemind's own messages in full")

    health = commands.add_parser("coordinator-health", help="exit 0 while a coordinator of the run beats (within "
                                                            "DEDLOC_COORDINATOR_TIMEOUT), else 1 saying why: a "
                                                            "container health check")
    health.add_argument("--run", required=True, help="the run's slug")
    commands.add_parser("portal-health", help="exit 0 when the portal on DEDLOC_PORT here answers /healthz, else 1 "
                                              "saying why: a container health check")

    demo = commands.add_parser("demo", help="portal, coordinator and two local workers, until Ctrl-C")
    demo.add_argument("--workers", type=int, default=2)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings()
    try:
        return COMMANDS[args.command](args, settings) or 0
    except DedlocError as e:
        print(f"dedloc: {e}", file=sys.stderr)
        return e.exit_code


def cmd_migrate(args, settings: Settings) -> None:
    from app.core.database import migrate

    migrate(settings.resolved_database_url)
    print("database is at the newest schema")


def cmd_create_run(args, settings: Settings) -> None:
    from app.core.database import make_engine, make_sessionmaker, migrate
    from app.core.errors import Invalid
    from app.runs import registry

    migrate(settings.resolved_database_url)
    with make_sessionmaker(make_engine(settings.resolved_database_url))() as session:
        if args.if_missing and any(run.slug == args.slug for run in registry.list_runs(session)):
            print(f"run {args.slug!r} already exists")
            return
        missing = [str(path) for path in args.files if not path.is_file()]
        if missing:
            raise Invalid(f"--file {missing[0]}: no such file")
        run = registry.create_run_with_files(
            session, settings.data_dir, {path.name: path for path in args.files},
            slug=args.slug, title=args.title or args.slug, task=args.task,
            target_batch_size=args.target_batch_size, batch_size=args.batch_size,
            task_options=args.task_options, optimizer=args.optimizer,
            samples_per_second_ceiling=args.samples_per_second_ceiling, target_epochs=target_epochs(args),
            checkpoints=args.checkpoints,
        )
    print(f"created run {run.slug!r}")


def target_epochs(args) -> int | None:
    """Steps from --target-epochs, or from --target-samples (each step averages --target-batch-size samples)."""
    if args.target_samples is None:
        return args.target_epochs
    return max(-(-args.target_samples // max(args.target_batch_size, 1)), 0) or -1  # 0 samples: refused as < 1


def open_session(settings: Settings):
    """A session on the migrated database; its engine is disposed after (no connection left to the collector)."""
    from app.core.database import one_session

    return one_session(settings.resolved_database_url)


def cmd_issue_credential(args, settings: Settings) -> None:
    from app.identity.accounts import issue_headless_credential

    with open_session(settings) as session:
        print(issue_headless_credential(session, args.username))


def cmd_ban(args, settings: Settings) -> None:
    from app.authority import tokens
    from app.runs import registry

    with open_session(settings) as session:
        tokens.ban_user(session, registry.get_run(session, args.slug), args.username, "operator", args.reason)
    print(f"{args.username} is banned from {args.slug}")


def cmd_unban(args, settings: Settings) -> None:
    from app.authority import tokens
    from app.runs import registry

    with open_session(settings) as session:
        tokens.unban_user(session, registry.get_run(session, args.slug), args.username)
    print(f"{args.username} may join {args.slug} again")


def cmd_set_ceiling(args, settings: Settings) -> None:
    from app.credit.review import change_ceiling
    from app.runs import registry

    with open_session(settings) as session:
        redecided = change_ceiling(session, registry.get_run(session, args.slug), args.samples_per_second)
    print(f"run {args.slug!r}: ceiling {args.samples_per_second:,g} samples/s per peer; {redecided} held claims "
          "re-decided")


def cmd_export_stats(args, settings: Settings) -> None:
    from app.credit.stats_export import export_stats, stats_dir

    out = args.out or stats_dir(settings.data_dir)
    with open_session(settings) as session:
        written = export_stats(session, out)
    print(f"wrote {', '.join(path.name for path in written)} to {out}")


def cmd_serve(args, settings: Settings) -> None:
    import os

    import uvicorn

    from app.core.database import migrate
    from app.core.errors import Invalid
    from app.core.secrets import secret_key
    from app.web.main import create_app

    chosen = {k: v for k, v in (("host", args.host), ("port", args.port), ("web_processes", args.workers)) if v}
    settings = settings.model_copy(update=chosen)
    if settings.web_processes < 1:
        raise Invalid("--workers must be at least 1")
    migrate(settings.resolved_database_url)
    secret_key(settings)  # created here, once, before the processes that read it start
    options: dict[str, Any] = dict(host=settings.host, port=settings.port, timeout_graceful_shutdown=2,
                                   log_level="warning")
    if settings.web_processes == 1:
        uvicorn.run(create_app(settings), **options)
        return
    # Several processes: uvicorn starts each with the factory, which reads its settings from the environment, so
    # the options given here go there first. Sessions are signed cookies; device codes, rate limits, tokens and
    # /metrics come from the database; each process runs its own live-update reader (app/web/live.py).
    os.environ.update({"DEDLOC_HOST": settings.host, "DEDLOC_PORT": str(settings.port)})
    uvicorn.run("app.web.main:create_app", factory=True, workers=settings.web_processes, **options)


def cmd_coordinator(args, settings: Settings) -> None:
    from app.coordinator.addresses import announced_maddrs

    if args.announce:
        settings = settings.model_copy(update={"announce_maddrs": args.announce})
    announced_maddrs(settings.announce_maddrs, args.listen)  # a wrong address is refused before seconds of imports

    from dedloc_worker.terminal import quiet

    from app.coordinator.node import CoordinatorNode

    quiet(args.verbose)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    CoordinatorNode(settings, args.run, args.listen).serve(stop)


def cmd_coordinator_health(args, settings: Settings) -> int:
    from app.cli.health import coordinator_health

    return coordinator_health(settings, args.run)


def cmd_portal_health(args, settings: Settings) -> int:
    from app.cli.health import portal_health

    return portal_health(settings)


def cmd_demo(args, settings: Settings) -> None:
    from app.cli.demo import run_demo

    run_demo(settings, args.workers)


COMMANDS = {
    "migrate": cmd_migrate,
    "create-run": cmd_create_run,
    "issue-credential": cmd_issue_credential,
    "ban": cmd_ban,
    "unban": cmd_unban,
    "set-ceiling": cmd_set_ceiling,
    "export-stats": cmd_export_stats,
    "serve": cmd_serve,
    "coordinator": cmd_coordinator,
    "coordinator-health": cmd_coordinator_health,
    "portal-health": cmd_portal_health,
    "demo": cmd_demo,
}


if __name__ == "__main__":
    raise SystemExit(main())
