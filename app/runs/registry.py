"""Runs and the coordinators that serve them: create, look up, describe to workers."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any, Optional

from dedloc_common.contract import RUN_STATES, CheckpointOptions, JoinInfo, OptimizerOptions, RunConfig
from dedloc_common.tasks import TaskOptionError, validate_task
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.clock import as_utc, utcnow
from app.core.errors import Invalid, NotFound
from app.credit.ceiling import DEFAULT_CEILING
from app.models import Coordinator, Run

SLUG = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
# Slugs that name portal pages under /runs/ (the new-run form), not runs.
RESERVED_SLUGS = ("new",)
TITLE_LENGTH = 200  # runs.title


def create_run(
    session: Session,
    *,
    slug: str,
    title: str,
    task: str = "tiny-lm",
    target_batch_size: int = 4096,
    batch_size: int = 16,
    task_options: Optional[dict[str, Any]] = None,
    optimizer: Optional[dict[str, Any]] = None,
    seed: int = 0,
    samples_per_second_ceiling: Optional[float] = None,
    target_epochs: Optional[int] = None,
    checkpoints: Optional[dict[str, Any]] = None,
    created_by: Optional[str] = None,
    commit: bool = True,
) -> Run:
    """Create a run; ``Invalid`` naming the option when the slug is malformed or taken, or an option is bad.
    With ``commit=False`` the caller commits (after storing the run's files). ``samples_per_second_ceiling``: the
    organizer's plausible samples per second per peer; None derives it from the swarm's rates (app.credit.ceiling)."""
    if not SLUG.match(slug):
        raise Invalid(f"slug {slug!r} must be lowercase letters, digits and dashes (at most 63)")
    if slug in RESERVED_SLUGS:
        raise Invalid(f"slug {slug!r} is the name of a portal page; choose another")
    if session.scalar(select(Run).where(Run.slug == slug)):
        raise Invalid(f"a run named {slug!r} already exists")
    if samples_per_second_ceiling is not None and not 0 < samples_per_second_ceiling < float("inf"):
        raise Invalid("samples_per_second_ceiling must be positive (or none: derived from the swarm's rates)")
    if target_batch_size < batch_size or batch_size < 1:
        raise Invalid("target_batch_size must be at least batch_size, and batch_size at least 1")
    title = _checked_title(title)
    _check_target_epochs(target_epochs)
    try:
        task_options = validate_task(task, task_options or {})
    except TaskOptionError as e:
        raise Invalid(str(e)) from None
    run = Run(
        slug=slug,
        title=title,
        task=task,
        task_options=task_options,
        target_epochs=target_epochs,
        checkpoints=_checked(CheckpointOptions, checkpoints or {}, "checkpoints"),
        created_by=created_by,
        state="active",
        target_batch_size=target_batch_size,
        batch_size=batch_size,
        seed=seed,
        samples_per_second_ceiling=samples_per_second_ceiling or DEFAULT_CEILING,
        ceiling_from_organizer=samples_per_second_ceiling is not None,
        optimizer=_checked(OptimizerOptions, optimizer or {}, "optimizer"),
    )
    session.add(run)
    if commit:
        session.commit()
    else:
        session.flush()
    return run


def edit_run(session: Session, run: Run, *, title: str, target_epochs: Optional[int], optimizer: dict[str, Any],
             checkpoints: dict[str, Any]) -> None:
    """Change what organizers may change after creation, checked as ``create_run`` checks it (``Invalid`` naming
    the option; then nothing changes). The coordinator reads the target at its next poll, workers the optimizer
    options when they join, the checkpointer its options when its coordinator starts."""
    _check_target_epochs(target_epochs)
    values = (_checked_title(title), target_epochs, _checked(OptimizerOptions, optimizer or {}, "optimizer"),
              _checked(CheckpointOptions, checkpoints or {}, "checkpoints"))
    run.title, run.target_epochs, run.optimizer, run.checkpoints = values
    session.commit()


def _checked_title(title: str) -> str:
    title = (title or "").strip()
    if not 1 <= len(title) <= TITLE_LENGTH:
        raise Invalid(f"title must be 1 to {TITLE_LENGTH} characters")
    return title


def _check_target_epochs(target_epochs: Optional[int]) -> None:
    if target_epochs is not None and target_epochs < 1:
        raise Invalid("target_epochs must be at least 1 (or none: the run trains until its organizers end it)")


def _checked(model, values: dict[str, Any], name: str) -> dict[str, Any]:
    """``values`` through a pydantic model; ``Invalid`` naming the first bad option."""
    from pydantic import ValidationError

    try:
        return model.model_validate(values).model_dump()
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in (name, *first["loc"]))
        raise Invalid(f"{where}: {first['msg']}") from None


def get_run(session: Session, slug: str) -> Run:
    run = session.scalar(select(Run).where(Run.slug == slug))
    if run is None:
        raise NotFound(f"no run named {slug!r}")
    return run


def list_runs(session: Session) -> list[Run]:
    return list(session.scalars(select(Run).order_by(Run.created_at.desc(), Run.id.desc())))


def run_config(run: Run) -> RunConfig:
    return RunConfig(
        slug=run.slug,
        run_id=f"dedloc-{run.slug}",
        task=run.task,
        task_options=run.task_options,
        target_batch_size=run.target_batch_size,
        batch_size=run.batch_size,
        seed=run.seed,
        optimizer=OptimizerOptions(**run.optimizer),
        target_epochs=run.target_epochs,
        state=run.state or "active",
        # the organizer's, or the default until the signed plan carries the derived one (PlanRecord.ceiling)
        samples_per_second_ceiling=run.samples_per_second_ceiling,
    )


def live_coordinators(session: Session, run: Run, timeout: float) -> list[Coordinator]:
    since = utcnow() - timedelta(seconds=timeout)
    rows = session.scalars(select(Coordinator).where(Coordinator.run_id == run.id))
    return [row for row in rows if is_up(row, since)]


def is_up(row: Coordinator, since) -> bool:
    """Whether a coordinator beat after ``since`` and has not stopped since."""
    return row.stopped_at is None and row.heartbeat_at is not None and as_utc(row.heartbeat_at) >= since


def join_info(session: Session, run: Run, coordinator_timeout: float) -> JoinInfo:
    """The run config, the coordinators' addresses, and the newest checkpoint (its url relative to the portal)."""
    from app.runs import checkpoints

    peers = [addr for row in live_coordinators(session, run, coordinator_timeout) for addr in row.multiaddrs]
    newest = checkpoints.latest(session, run)
    return JoinInfo(config=run_config(run), initial_peers=peers,
                    checkpoint=None if newest is None else checkpoints.describe(newest, run.slug),
                    notice=None if peers else no_coordinator_notice(session, run))


def no_coordinator_notice(session: Session, run: Run) -> str:
    """In words: no coordinator of ``run`` is up, and when the last one was."""
    beats = [as_utc(row.heartbeat_at) for row in session.scalars(select(Coordinator).where(
        Coordinator.run_id == run.id)) if row.heartbeat_at is not None]
    if not beats:
        return f"no coordinator of run {run.slug!r} has started yet; workers wait until one is up"
    ago = (utcnow() - max(beats)).total_seconds()
    return (f"no coordinator of run {run.slug!r} is up (last heartbeat {ago:.0f} s ago); workers wait until one "
            "is up, and training peers carry on meanwhile")


def set_state(session: Session, run: Run, state: str) -> None:
    """Pause, resume or finish a run; workers follow within seconds (they ask the portal)."""
    if state not in RUN_STATES:
        raise Invalid(f"state {state!r}: use one of {', '.join(RUN_STATES)}")
    if run.state == "finished" and state != "finished":
        raise Invalid(f"run {run.slug!r} is finished; create a new run to train further")
    run.state = state
    session.commit()


def register_coordinator(session: Session, run: Run, peer_id: str, multiaddrs: list[str]) -> Coordinator:
    """Record (or refresh) a coordinator of ``run``; a restart with the same identity reuses its row."""
    row = find_coordinator(session, run, peer_id)
    if row is None:
        row = Coordinator(run_id=run.id, peer_id=peer_id, multiaddrs=multiaddrs, known_peers=[])
        session.add(row)
    row.multiaddrs, row.started_at, row.heartbeat_at, row.stopped_at = multiaddrs, utcnow(), utcnow(), None
    session.commit()
    return row


def known_worker_addrs(session: Session, run: Run) -> list[str]:
    """Worker addresses any coordinator of ``run`` saw lately (for bootstrapping a restarted or second one)."""
    rows = session.scalars(select(Coordinator).where(Coordinator.run_id == run.id))
    return sorted({addr for row in rows for addr in row.known_peers})


def find_coordinator(session: Session, run: Run, peer_id: str) -> Optional[Coordinator]:
    return session.scalar(select(Coordinator).where(Coordinator.run_id == run.id, Coordinator.peer_id == peer_id))


def heartbeat(session: Session, coordinator_id: int, alive: bool = True, known_peers: Optional[list[str]] = None):
    """Mark a coordinator alive (or stopped, keeping its last heartbeat), remembering the worker addresses it saw
    if given."""
    row = session.get(Coordinator, coordinator_id)
    if row is not None:
        if alive:
            row.heartbeat_at, row.stopped_at = utcnow(), None
        else:
            row.stopped_at = utcnow()
        if known_peers:
            row.known_peers = known_peers
        session.commit()



def create_run_with_files(session: Session, data_dir, uploads: dict[str, Any], **options) -> Run:
    """Create a run and store the files it names (``uploads``: name -> local path), training its tokenizer if it
    asks for one; nothing is kept when any step fails (``Invalid`` naming the option)."""
    from app.runs import files

    run = create_run(session, commit=False, **options)
    try:
        files.add_run_files(data_dir, run.slug, run.task, run.task_options, uploads)
        if run.created_by:
            from app.models import RunOrganizer

            session.add(RunOrganizer(run_id=run.id, username=run.created_by))
        session.commit()
    except BaseException:
        session.rollback()
        files.remove_all(data_dir, run.slug)
        raise
    return run


def organizers(session: Session, run: Run) -> list[str]:
    """The run's own organizers (its creator and whom they added), besides the portal-wide DEDLOC_ORGANIZERS."""
    from app.models import RunOrganizer

    return sorted(session.scalars(select(RunOrganizer.username).where(RunOrganizer.run_id == run.id)))


def may_organize(session: Session, settings, run: Run, user) -> bool:
    from app.identity.accounts import is_organizer

    return user is not None and (is_organizer(settings, user) or user.username in organizers(session, run))


def add_organizer(session: Session, run: Run, username: str) -> None:
    from app.models import RunOrganizer

    if username not in organizers(session, run):
        session.add(RunOrganizer(run_id=run.id, username=username))
        session.commit()
