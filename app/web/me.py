"""The signed-in volunteer's own page: their peers, credit per epoch, held epochs with reasons, and settings."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from app.credit import standings, volunteers
from app.web.identity import CsrfChecked, CurrentUser
from app.web.deps import SessionDep

router = APIRouter(include_in_schema=False)


@router.get("/me", response_class=HTMLResponse)
def my_contribution(request: Request, user: CurrentUser, session: SessionDep):
    return request.app.state.templates.TemplateResponse(request, "me.html", {
        "user": user, "totals": standings.user_totals(session, user.username, public=False),
        "peers": volunteers.own_peers(session, user.username), "epochs": volunteers.own_epochs(session, user.username),
        "epochs_shown": volunteers.EPOCHS_SHOWN,
        "held": volunteers.held_epochs(session, user.username),
    })


@router.post("/me/settings", dependencies=[CsrfChecked])
def change_settings(user: CurrentUser, session: SessionDep, hidden: Annotated[bool, Form()] = False,
                    team: Annotated[str, Form(max_length=100)] = ""):
    volunteers.change_settings(session, user, hidden=hidden, team=team)
    return RedirectResponse("/me", status_code=303)
