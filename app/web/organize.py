"""The organizers' page of a run: its settings and state, its organizers, admission policy, allowlist, bans, who
holds tokens, and held credit."""

from __future__ import annotations

from typing import Annotated, Optional

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from app.authority import tokens
from app.core.errors import Forbidden, Invalid
from app.credit import review, spot_checks
from app.identity.models import User
from app.models import Run
from app.runs import registry
from app.web.deps import RunDep, SessionDep, SettingsDep
from app.web.form_values import json_object, pretty, whole
from app.web.identity import CsrfChecked, CurrentUser

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


def run_values(run: Run) -> dict[str, str]:
    """The settings form's fields as the run has them now."""
    return {"title": run.title, "target_epochs": "" if run.target_epochs is None else str(run.target_epochs),
            "optimizer": pretty(run.optimizer), "checkpoints": pretty(run.checkpoints)}


def render(request: Request, run: Run, session, values: Optional[dict[str, str]] = None, error: str = "",
           status_code: int = 200, ceiling_error: str = ""):
    return request.app.state.templates.TemplateResponse(request, "organize.html", {
        "run": run, "values": values or run_values(run), "settings_error": error,
        "organizers": registry.organizers(session, run),
        "policies": tokens.ADMISSION_POLICIES, "allowlist": tokens.allowlist(session, run),
        "bans": tokens.bans(session, run), "holders": tokens.token_holders(session, run),
        "held": review.held_credit(session, run), "disputed": review.disputed_claims(session, run),
        "disputers": review.disputers(session, run), "ceiling_error": ceiling_error,
        "spot_checks": spot_checks.summary(session, run),
    }, status_code=status_code)


@router.get("/runs/{slug}/organize", response_class=HTMLResponse)
def organize_page(request: Request, run: RunDep, user: Organizer, session: SessionDep):
    return render(request, run, session)


@router.post("/runs/{slug}/organize/settings", dependencies=[CsrfChecked])
def change_settings(request: Request, run: RunDep, user: Organizer, session: SessionDep,
                    title: Annotated[str, Form(max_length=1000)] = "",
                    target_epochs: Annotated[str, Form(max_length=20)] = "",
                    optimizer: Annotated[str, Form(max_length=100_000)] = "",
                    checkpoints: Annotated[str, Form(max_length=100_000)] = ""):
    values = {"title": title, "target_epochs": target_epochs, "optimizer": optimizer, "checkpoints": checkpoints}
    try:
        registry.edit_run(session, run, title=title, target_epochs=whole(target_epochs, "target_epochs", True),
                          optimizer=json_object(optimizer, "optimizer"),
                          checkpoints=json_object(checkpoints, "checkpoints"))
    except Invalid as e:  # the form again, as typed, with the reason
        return render(request, run, session, values, str(e), status_code=422)
    return back(run)


@router.post("/runs/{slug}/organize/ceiling", dependencies=[CsrfChecked])
def change_ceiling(request: Request, run: RunDep, user: Organizer, session: SessionDep,
                   ceiling: Annotated[str, Form(max_length=40)] = ""):
    try:
        value = float(ceiling.replace(",", "").replace("_", ""))
    except ValueError:
        value = float("nan")
    try:
        review.change_ceiling(session, run, value)
    except Invalid as e:
        return render(request, run, session, ceiling_error=f"{e} (got {ceiling!r})", status_code=422)
    return back(run)


@router.post("/runs/{slug}/organize/state", dependencies=[CsrfChecked])
def change_state(run: RunDep, user: Organizer, session: SessionDep, state: Annotated[str, Form(max_length=20)]):
    registry.set_state(session, run, state)
    return back(run)


@router.post("/runs/{slug}/organize/organizers", dependencies=[CsrfChecked])
def add_organizer(run: RunDep, user: Organizer, session: SessionDep, username: Username):
    registry.add_organizer(session, run, username)
    return back(run)


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


@router.post("/runs/{slug}/organize/lift", dependencies=[CsrfChecked])
def lift(run: RunDep, user: Organizer, session: SessionDep, username: Username):
    """End the hold spot checks put on an account: its claims are decided again as any other's."""
    review.lift_holds(session, run, username, lifted_by=user.username)
    return back(run)
