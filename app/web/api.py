"""The public JSON API under /api/v1."""

from __future__ import annotations

from typing import Annotated, Optional

from dedloc_common.contract import API_PREFIX, CheckpointInfo, JoinInfo, RunFile
from dedloc_common.tasks import FILE_NAME
from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import FileResponse

from app.credit import ledger, standings
from app.runs import checkpoints, evaluations, files, plans, registry, snapshots
from app.runs.progress import RunProgress, run_progress
from app.runs.status import RunStatus, run_status
from app.web.deps import RunDep, SessionDep, SettingsDep
from app.web.responses import BINARY, BUSY, UNKNOWN_RUN, error
from app.web.schemas import RunOut, SwarmOut, UtcDateTimeIn
from app.web.views import current_swarm, run_out, swarm_out

router = APIRouter(prefix=API_PREFIX, tags=["api"], responses=BUSY)
# Epochs are 32-bit integers in the database (PostgreSQL's integer).
MAX_EPOCH = 2**31 - 1


@router.get("/runs", response_model=list[RunOut])
def list_runs(session: SessionDep):
    return [run_out(run) for run in registry.list_runs(session)]


@router.get("/runs/{slug}", response_model=RunOut, responses=UNKNOWN_RUN)
def get_run(run: RunDep):
    return run_out(run)


@router.get("/runs/{slug}/join", response_model=JoinInfo, responses=UNKNOWN_RUN)
def join(run: RunDep, session: SessionDep, settings: SettingsDep):
    """What a worker needs to join: the run config and the coordinators' addresses."""
    return registry.join_info(session, run, settings.coordinator_timeout)


@router.get("/runs/{slug}/status", response_model=RunStatus, responses=UNKNOWN_RUN)
def status(run: RunDep, session: SessionDep, settings: SettingsDep):
    """Whether the run can be joined now: each coordinator up or down with its last heartbeat, the peers online
    by reachability (reachable, found unreachable, client by choice), and the portal's version."""
    return run_status(session, run, settings.coordinator_timeout)


@router.get("/runs/{slug}/swarm", response_model=SwarmOut, responses=UNKNOWN_RUN)
def swarm(run: RunDep, session: SessionDep):
    return current_swarm(session, run)


@router.get("/runs/{slug}/history", response_model=list[SwarmOut], responses=UNKNOWN_RUN)
def history(
    run: RunDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=10_000, description="at most this many snapshots, newest kept")] = 500,
    since: Annotated[Optional[UtcDateTimeIn], Query(description="only snapshots after this RFC 3339 time")] = None,
    step: Annotated[int, Query(ge=0, le=31 * 86400, description=(
        "seconds: only the newest snapshot of each interval this long (0: every snapshot). History older than a "
        "day is kept one a minute, older than 30 days one an hour"))] = 0,
):
    """The swarm over time, oldest first: the newest ``limit`` snapshots, thinned to one per ``step`` seconds."""
    return [swarm_out(run, snapshot) for snapshot in snapshots.history(session, run, limit, since, step)]


@router.get("/runs/{slug}/plan", response_model=plans.PublicPlan,
            responses={404: error("unknown run, or no plan published yet")})
def plan(run: RunDep, session: SessionDep):
    """The current averaging plan: each peer's role, share of the vector and measured Mbit/s (a short
    fingerprint of its key, no keys or addresses), and the predicted, measured and lower-bound round times."""
    return plans.published_plan(session, run)


Limit = Annotated[int, Query(ge=1, le=1000, description="at most this many rows, from the top")]


@router.get("/runs/{slug}/leaderboard", response_model=list[ledger.LeaderboardEntry], responses=UNKNOWN_RUN)
def leaderboard(run: RunDep, session: SessionDep, limit: Limit = 100):
    """Users by credited samples in this run, most first; users hidden from public boards are left out."""
    return ledger.leaderboard(session, run, limit)


@router.get("/runs/{slug}/teams", response_model=list[standings.TeamEntry], responses=UNKNOWN_RUN)
def run_teams(run: RunDep, session: SessionDep, limit: Limit = 100):
    """Teams by their public members' credited samples in this run, most first."""
    return standings.team_leaderboard(session, run, limit)


@router.get("/leaderboard", response_model=list[ledger.LeaderboardEntry])
def overall_leaderboard(session: SessionDep, limit: Limit = 100):
    """Users by credited samples across all runs, most first."""
    return ledger.leaderboard(session, None, limit)


@router.get("/teams", response_model=list[standings.TeamEntry])
def teams(session: SessionDep, limit: Limit = 100):
    """Teams by their public members' credited samples across all runs, most first."""
    return standings.team_leaderboard(session, None, limit)


@router.get("/users/{username}", response_model=standings.UserTotals,
            responses={404: error("unknown or hidden")})
def user(session: SessionDep, username: Annotated[str, Path(max_length=100)]):
    """A user's public totals across runs and per run; 404 alike for unknown users and hidden ones."""
    return standings.user_totals(session, username)


@router.get("/runs/{slug}/files", response_model=list[RunFile], responses=UNKNOWN_RUN)
def run_files(run: RunDep, settings: SettingsDep):
    """The files the run serves its workers: the organizer's data and the tokenizer trained at creation."""
    return files.listed(settings.data_dir, run.slug)


@router.get("/runs/{slug}/files/{name}", response_class=FileResponse, responses={
    200: {"content": {"application/octet-stream": {"schema": BINARY}},
          "description": "the file"},
    404: error("unknown run, or no such file")})
def run_file(run: RunDep, settings: SettingsDep, name: Annotated[str, Path(pattern=FILE_NAME)]):
    return FileResponse(files.path_of(settings.data_dir, run.slug, name), media_type="application/octet-stream",
                        filename=name)


@router.get("/runs/{slug}/checkpoints", response_model=list[CheckpointInfo], responses=UNKNOWN_RUN)
def list_checkpoints(run: RunDep, session: SessionDep, request: Request):
    """The run's stored checkpoints, newest first; ``url`` downloads one as a tar archive."""
    base = str(request.base_url).rstrip("/")
    return [checkpoints.describe(row, run.slug, base) for row in checkpoints.newest_first(session, run)]


@router.get("/runs/{slug}/evaluations", response_model=list[evaluations.EvaluationOut], responses=UNKNOWN_RUN)
def list_evaluations(run: RunDep, session: SessionDep):
    """Every evaluation the checkpointer made (held-out loss by epoch), oldest first, including those whose
    checkpoint archive was pruned since."""
    return evaluations.series(session, run)


@router.get("/runs/{slug}/checkpoints/{epoch}.tar", response_class=FileResponse,
            responses={200: {"content": {"application/x-tar": {"schema": BINARY}},
                             "description": "the checkpoint's tar archive"},
                       404: error("unknown run, or no checkpoint at that epoch")})
def download_checkpoint(run: RunDep, session: SessionDep, settings: SettingsDep,
                        epoch: Annotated[int, Path(ge=0, le=MAX_EPOCH)]):
    """A checkpoint as one tar archive: config.json, model.safetensors, tokenizer files (they load with
    ``from_pretrained`` after extraction), and the training state a resuming swarm starts from."""
    path = checkpoints.archive_of(session, settings.data_dir, run, epoch)
    return FileResponse(path, media_type="application/x-tar", filename=f"{run.slug}-epoch-{epoch}.tar")


@router.get("/runs/{slug}/progress", response_model=RunProgress, responses=UNKNOWN_RUN)
def progress(run: RunDep, session: SessionDep):
    """How far the run is from its target, the time left with a range, and how many recent rounds did not form."""
    return run_progress(session, run)
