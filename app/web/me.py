"""The signed-in volunteer's own page: their peers, credit per epoch, held epochs with reasons, their machines'
credentials (revocable), and settings."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from app.core.errors import NotFound
from app.credit import attestations, standings, volunteers
from app.identity import accounts
from app.web.deps import SessionDep, SettingsDep
from app.web.identity import CsrfChecked, CurrentUser

router = APIRouter(include_in_schema=False)


@router.get("/me", response_class=HTMLResponse)
def my_contribution(request: Request, user: CurrentUser, session: SessionDep, settings: SettingsDep):
    return request.app.state.templates.TemplateResponse(request, "me.html", {
        "user": user, "totals": standings.user_totals(session, user.username, public=False),
        "peers": volunteers.own_peers(session, user.username), "epochs": volunteers.own_epochs(session, user.username),
        "epochs_shown": volunteers.EPOCHS_SHOWN,
        "held": volunteers.held_epochs(session, user.username),
        "cuts": attestations.own_cuts(session, user.username),
        "credentials": accounts.machine_credentials(session, user.id),
        "token_minutes": max(1, round(settings.peer_token_lifetime / 60)),
    })


@router.post("/me/credentials/{credential_id}/revoke", dependencies=[CsrfChecked])
def revoke_credential(credential_id: int, user: CurrentUser, session: SessionDep):
    """Revoke one machine's credential: its next API call is refused (its live peer tokens run out on their own)."""
    if not accounts.revoke_machine_credential(session, user.id, credential_id):
        raise NotFound("you have no credential by that number that is still valid; reload the page")
    return RedirectResponse("/me#machines", status_code=303)


@router.post("/me/settings", dependencies=[CsrfChecked])
def change_settings(user: CurrentUser, session: SessionDep, hidden: Annotated[bool, Form()] = False,
                    team: Annotated[str, Form(max_length=100)] = ""):
    volunteers.change_settings(session, user, hidden=hidden, team=team)
    return RedirectResponse("/me", status_code=303)
