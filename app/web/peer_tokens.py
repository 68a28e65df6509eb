"""What a worker's admission needs from the portal: peer tokens (``POST /api/v1/runs/{slug}/peer-tokens``) and
the run's signed denylist (``GET /api/v1/runs/{slug}/denylist``)."""

from __future__ import annotations

from dedloc_common.contract import API_PREFIX, PeerTokenGrant, PeerTokenRequest, SignedDenylist
from fastapi import APIRouter

from app.authority import tokens
from app.web.deps import RunDep, SessionDep, SettingsDep
from app.web.identity import ApiUser
from app.web.responses import BUSY, NEEDS_CREDENTIAL, RETRY_AFTER, UNKNOWN_RUN, error

router = APIRouter(prefix=API_PREFIX, tags=["api"], responses=BUSY)


@router.post("/runs/{slug}/peer-tokens", response_model=PeerTokenGrant, responses={
    **NEEDS_CREDENTIAL, **UNKNOWN_RUN, 400: error("the body is not JSON"),
    403: error("the run does not admit this user: banned, not allowlisted, not in its organization"),
    429: error("past a per-account limit: token requests a minute, or peers at once", RETRY_AFTER),
})
def issue_peer_token(run: RunDep, user: ApiUser, body: PeerTokenRequest, session: SessionDep,
                     settings: SettingsDep):
    """A token binding the signed-in user to the worker's key, signed by the run's authority (403 with the
    reason when the run does not admit the user, 429 with Retry-After past a per-account limit)."""
    return tokens.issue_peer_token(session, settings, run, user.username, body.public_key,
                                   organizations=user.organizations or [])


@router.get("/runs/{slug}/denylist", response_model=SignedDenylist, responses={**NEEDS_CREDENTIAL, **UNKNOWN_RUN})
def denylist(run: RunDep, user: ApiUser, session: SessionDep, settings: SettingsDep):
    """The run's banned usernames, signed now by its authority: workers ask every few seconds, so a ban reaches
    running peers while no coordinator is up to publish it in the DHT. Signed-in callers only (it names users)."""
    return tokens.signed_denylist(session, settings, run)
