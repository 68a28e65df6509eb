"""The organizers' page of a run: admission policy, allowlist, bans, who holds tokens, and held credit."""

from __future__ import annotations

from typing import Annotated, Optional

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from app.credit import review

from app.authority import tokens
from app.runs import registry
from app.web.identity import CsrfChecked, CurrentUser
from app.identity.models import User
from app.core.errors import Forbidden
from app.models import Run
from app.web.deps import RunDep, SessionDep, SettingsDep

router = APIRouter(include_in_schema=False)
Username = Annotated[str, Form(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]


def organizer(user: CurrentUser, settings: SettingsDep, run: RunDep, session: SessionDep) -> User:
    if not registry.may_organize(session, settings, run, user):
        raise Forbidden(f"{user.username} is not an organizer of run {run.slug!r} (its creator and whom they add) "
                        "nor of this portal (DEDLOC_ORGANIZERS)")
    return user


Organizer = Annotated[User, Depends(organizer)]


def back(run: Run) -> RedirectResponse:
    return RedirectResponse(f"/runs/{run.slug}/organize", status_code=303)


@router.get("/runs/{slug}/organize", response_class=HTMLResponse)
def organize_page(request: Request, run: RunDep, user: Organizer, session: SessionDep):
    return request.app.state.templates.TemplateResponse(request, "organize.html", {
        "run": run, "policies": tokens.ADMISSION_POLICIES, "allowlist": tokens.allowlist(session, run),
        "bans": tokens.bans(session, run), "holders": tokens.token_holders(session, run),
        "held": review.held_credit(session, run),
    })


@router.post("/runs/{slug}/organize/admission", dependencies=[CsrfChecked])
def change_admission(run: RunDep, user: Organizer, session: SessionDep, policy: Annotated[str, Form()],
                     org: Annotated[str, Form(max_length=100)] = ""):
    tokens.set_admission(session, run, policy, org)
    return back(run)


@router.post("/runs/{slug}/organize/allow", dependencies=[CsrfChecked])
def allow(run: RunDep, user: Organizer, session: SessionDep, username: Username):
    tokens.allow_user(session, run, username)
    return back(run)


@router.post("/runs/{slug}/organize/disallow", dependencies=[CsrfChecked])
def disallow(run: RunDep, user: Organizer, session: SessionDep, username: Username):
    tokens.disallow_user(session, run, username)
    return back(run)


@router.post("/runs/{slug}/organize/ban", dependencies=[CsrfChecked])
def ban(run: RunDep, user: Organizer, session: SessionDep, username: Username,
        reason: Annotated[str, Form(max_length=500)] = ""):
    tokens.ban_user(session, run, username, banned_by=user.username, reason=reason)
    return back(run)


@router.post("/runs/{slug}/organize/unban", dependencies=[CsrfChecked])
def unban(run: RunDep, user: Organizer, session: SessionDep, username: Username):
    tokens.unban_user(session, run, username)
    return back(run)


@router.post("/runs/{slug}/organize/release", dependencies=[CsrfChecked])
def release(run: RunDep, user: Organizer, session: SessionDep, username: Username,
            epoch: Annotated[Optional[int], Form(ge=0, description="one epoch; empty: every held epoch")] = None):
    review.release_held(session, run=run, username=username, released_by=user.username, epoch=epoch)
    return back(run)
