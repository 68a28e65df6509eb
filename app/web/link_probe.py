"""Link probes: what a worker asks the portal about its own network at join.

``GET /api/v1/runs/{slug}/link-probe?size=N`` answers N random bytes; ``POST`` reads the body and answers how many
bytes came (timed transfers: the worker's bandwidth in both directions). ``POST .../reachability`` dials the worker
back (``app.runs.reachability``): can peers connect to it, or must it be a client? All need the worker's API
credential, so the portal is no free bandwidth sink or dialer for anyone.
"""

from __future__ import annotations

import functools
import os
from typing import Annotated

from dedloc_common.contract import API_PREFIX, LINK_PROBE_MAX_BYTES, ReachabilityReport, ReachabilityRequest
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from app.core.errors import DedlocError, TooLarge
from app.web.deps import RunDep, SessionDep
from app.web.identity import ApiUser
from app.web.responses import BINARY, BUSY, NEEDS_CREDENTIAL, UNKNOWN_RUN, error
from app.web.schemas import ProbeReceipt

router = APIRouter(prefix=API_PREFIX, tags=["api"], responses={**BUSY, **NEEDS_CREDENTIAL, **UNKNOWN_RUN})

TOO_LARGE = f"a link probe carries at most {LINK_PROBE_MAX_BYTES} bytes; send a smaller body"


@functools.cache
def probe_bytes() -> bytes:
    """Random, so that no compression on the way makes the link look faster; drawn once per process."""
    return os.urandom(LINK_PROBE_MAX_BYTES)


def prober(user: ApiUser, session: SessionDep) -> str:
    """The credential's username. The database is done with once the credential is checked: a transfer on a slow
    link lasts seconds and must not hold a pooled connection meanwhile."""
    session.close()
    return user.username


Prober = Annotated[str, Depends(prober)]


@router.get("/runs/{slug}/link-probe", response_class=Response,
            responses={200: {"content": {"application/octet-stream": {"schema": BINARY}},
                             "description": "size random bytes"}})
def download_probe(run: RunDep, username: Prober, size: Annotated[int, Query(
        ge=1, le=LINK_PROBE_MAX_BYTES, description="bytes to send")]):
    """``size`` random bytes, never cached on the way (each transfer must cross the link)."""
    return Response(probe_bytes()[:size], media_type="application/octet-stream",
                    headers={"cache-control": "no-store"})


@router.post("/runs/{slug}/link-probe", response_model=ProbeReceipt,
             openapi_extra={"requestBody": {"content": {"application/octet-stream": {"schema": BINARY}}}},
             responses={400: error("the upload broke off before its end"),
                        413: error(f"a body over {LINK_PROBE_MAX_BYTES} bytes")})
async def upload_probe(request: Request, run: RunDep, username: Prober) -> ProbeReceipt:
    """Reads and discards the body; answers its length in bytes."""
    return ProbeReceipt(bytes=await count_body(request, LINK_PROBE_MAX_BYTES))


async def count_body(request: Request, limit: int) -> int:
    """Bytes in the request body; ``TooLarge`` as soon as it passes ``limit``, so an endless body is never read
    to its end."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise TooLarge(TOO_LARGE)
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise TooLarge(TOO_LARGE)
    except ClientDisconnect:
        raise DedlocError("the link probe upload broke off before its end; measure again") from None
    return received


@router.post("/runs/{slug}/reachability", response_model=ReachabilityReport,
             responses={400: error("the body is not JSON")})
async def reachability(run: RunDep, user: ApiUser, request: Request, body: ReachabilityRequest):
    """Dial the worker back on each port it announces, at the address its request comes from (and nowhere
    else): reachable when a libp2p peer answers on one, else why not, address by address."""
    from app.runs.reachability import dial_back

    return await dial_back(body.addrs, request.client.host if request.client else "")
