"""Live dashboard updates over server-sent events: the newest snapshot, every ``live_interval`` seconds."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from sse_starlette.sse import EventSourceResponse

from .. import runs
from .deps import RunDep
from .views import current_swarm

router = APIRouter()


@router.get("/runs/{slug}/events", include_in_schema=False)
async def events(request: Request, run: RunDep):
    sessions, interval = request.app.state.sessions, request.app.state.settings.live_interval

    def read() -> str:
        with sessions() as session:
            return current_swarm(session, runs.get_run(session, run.slug)).model_dump_json()

    async def stream():
        while not await request.is_disconnected():
            yield {"event": "swarm", "data": await run_in_threadpool(read)}
            await asyncio.sleep(interval)

    return EventSourceResponse(stream())
