"""The public JSON API under /api/v1."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Optional

from dedloc_worker.contract import API_PREFIX, JoinInfo
from fastapi import APIRouter, Query

from .. import accounting, runs, snapshots
from .deps import RunDep, SessionDep, SettingsDep
from .schemas import LeaderboardEntry, RunOut, SwarmOut
from .views import current_swarm, run_out, swarm_out

router = APIRouter(prefix=API_PREFIX, tags=["api"])


@router.get("/runs", response_model=list[RunOut])
def list_runs(session: SessionDep):
    return [run_out(run) for run in runs.list_runs(session)]


@router.get("/runs/{slug}", response_model=RunOut)
def get_run(run: RunDep):
    return run_out(run)


@router.get("/runs/{slug}/join", response_model=JoinInfo)
def join(run: RunDep, session: SessionDep, settings: SettingsDep):
    """What a worker needs to join: the run config and the coordinators' addresses."""
    return runs.join_info(session, run, settings.coordinator_timeout)


@router.get("/runs/{slug}/swarm", response_model=SwarmOut)
def swarm(run: RunDep, session: SessionDep):
    return current_swarm(session, run)


@router.get("/runs/{slug}/history", response_model=list[SwarmOut])
def history(
    run: RunDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=10_000, description="at most this many snapshots, newest kept")] = 500,
    since: Annotated[Optional[datetime], Query(description="only snapshots after this ISO 8601 time")] = None,
):
    return [swarm_out(run, snapshot) for snapshot in snapshots.history(session, run, limit, since)]


@router.get("/runs/{slug}/leaderboard", response_model=list[LeaderboardEntry])
def leaderboard(
    run: RunDep, session: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100
):
    return [LeaderboardEntry(**row.__dict__) for row in accounting.leaderboard(session, run, limit)]
