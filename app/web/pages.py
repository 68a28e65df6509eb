"""HTML pages: the runs, a run's live dashboard, its leaderboard, and the leaderboard across runs."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from app.core.clock import as_utc
from app.credit import attestations, ledger, standings
from app.runs import checkpoints, plans, registry, snapshots
from app.runs.progress import run_progress
from app.runs.status import run_status
from app.web.deps import RunDep, SessionDep, SettingsDep
from app.web.identity import OptionalUser, is_organizer
from app.web.views import current_swarm

router = APIRouter(default_response_class=HTMLResponse, include_in_schema=False)


def render(request: Request, template: str, **context):
    return request.app.state.templates.TemplateResponse(request, template, context)


@router.get("/")
def home(request: Request, session: SessionDep, settings: SettingsDep, user: OptionalUser):
    items = [(run, current_swarm(session, run)) for run in registry.list_runs(session)]
    return render(request, "home.html", items=items, can_create=is_organizer(settings, user))


@router.get("/runs/{slug}")
def dashboard(request: Request, run: RunDep, session: SessionDep, settings: SettingsDep, user: OptionalUser):
    base = str(request.base_url).rstrip("/")
    saved = [checkpoints.describe(row, run.slug, base) for row in checkpoints.newest_first(session, run)]
    return render(request, "dashboard.html", run=run, swarm=current_swarm(session, run),
                  leaders=ledger.leaderboard(session, run, 10), plan=plans.public_plan(session, run),
                  checkpoints=saved, progress=run_progress(session, run),
                  status=run_status(session, run, settings.coordinator_timeout),
                  can_organize=registry.may_organize(session, settings, run, user),
                  cuts=attestations.recent_cuts(session, run),
                  # the charts span the history from here: the run may have been created long before it trained
                  history_from=snapshots.first_taken_at(session, run) or as_utc(run.created_at))


@router.get("/runs/{slug}/leaderboard")
def leaderboard(request: Request, run: RunDep, session: SessionDep):
    return render(request, "leaderboard.html", run=run, leaders=ledger.leaderboard(session, run, 1000),
                  teams=standings.team_leaderboard(session, run, 1000))


@router.get("/leaderboard")
def overall_leaderboard(request: Request, session: SessionDep):
    return render(request, "leaderboard.html", run=None, leaders=ledger.leaderboard(session, None, 1000),
                  teams=standings.team_leaderboard(session, None, 1000))
