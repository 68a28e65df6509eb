"""Live dashboard updates over server-sent events, fanned out per process.

One reader per run and process takes a snapshot every ``live_interval`` seconds in a short database session and
hands what changed to every viewer of that run: a viewer costs a socket, never a database connection. A viewer
that reads slowly only ever has the newest value of each event waiting (nothing queues up behind it), and one
whose socket stalls longer than ``event_send_timeout`` is dropped.

Events: ``swarm`` (JSON, the API's SwarmOut), ``leaders`` and ``plan`` (HTML of the same partials the page is
rendered with, so each table has one renderer).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.templating import Jinja2Templates
from sqlalchemy.orm import Session, sessionmaker
from sse_starlette.sse import EventSourceResponse

from app.core.config import Settings
from app.core.errors import Unavailable
from app.credit import ledger
from app.runs import plans, registry
from app.web.deps import RunDep
from app.web.views import current_swarm

log = logging.getLogger(__name__)
router = APIRouter()


class Viewer:
    """One open stream: the newest payload of each event not yet sent, and a flag that wakes the sender."""

    def __init__(self, pending: dict[str, str]):
        self.pending = dict(pending)
        self.wake = asyncio.Event()
        if pending:
            self.wake.set()

    def offer(self, changed: dict[str, str]) -> None:
        self.pending.update(changed)
        self.wake.set()

    async def next_events(self) -> dict[str, str]:
        await self.wake.wait()
        self.wake.clear()
        ready, self.pending = self.pending, {}
        return ready


class Channel:
    """A run's viewers in this process and the last payload of each event."""

    def __init__(self) -> None:
        self.viewers: set[Viewer] = set()
        self.latest: dict[str, str] = {}
        self.reader: asyncio.Task | None = None


class LiveFeed:
    """Every run's live updates in this web process."""

    def __init__(self, sessions: sessionmaker[Session], templates: Jinja2Templates, settings: Settings):
        self.sessions, self.templates, self.settings = sessions, templates, settings
        self.channels: dict[str, Channel] = {}

    @property
    def viewer_count(self) -> int:
        return sum(len(channel.viewers) for channel in self.channels.values())

    def check_capacity(self) -> None:
        if self.viewer_count >= self.settings.max_event_streams:
            raise Unavailable("this portal serves as many live dashboards as it is set to; "
                              "the page still works without live updates, or retry shortly", retry_after=30)

    def subscribe(self, slug: str) -> Viewer:
        channel = self.channels.setdefault(slug, Channel())
        viewer = Viewer(channel.latest)
        channel.viewers.add(viewer)
        if channel.reader is None or channel.reader.done():
            channel.reader = asyncio.create_task(self._read_loop(slug, channel))
        return viewer

    def unsubscribe(self, slug: str, viewer: Viewer) -> None:
        channel = self.channels.get(slug)
        if channel is not None:
            channel.viewers.discard(viewer)

    async def close(self) -> None:
        readers = [c.reader for c in self.channels.values() if c.reader is not None]
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        self.channels.clear()

    async def _read_loop(self, slug: str, channel: Channel) -> None:
        """Read while anyone watches; the reader ends with the last viewer and the next one starts another."""
        while channel.viewers:
            try:
                payloads = await run_in_threadpool(self.read, slug)
            except Exception as error:  # a busy or briefly unreachable database: viewers keep the last values
                log.warning("live updates for %s: %s: %s", slug, type(error).__name__, error)
            else:
                changed = {name: data for name, data in payloads.items() if channel.latest.get(name) != data}
                if changed:
                    channel.latest.update(changed)
                    for viewer in list(channel.viewers):
                        viewer.offer(changed)
            await asyncio.sleep(self.settings.live_interval)
        if self.channels.get(slug) is channel and not channel.viewers:
            del self.channels[slug]

    def read(self, slug: str) -> dict[str, str]:
        """One snapshot of what a dashboard shows, in one short session."""
        with self.sessions() as session:
            run = registry.get_run(session, slug)
            return {
                "swarm": current_swarm(session, run).model_dump_json(),
                "leaders": self.templates.get_template("_leaders.html").render(
                    leaders=ledger.leaderboard(session, run, 10)),
                "plan": self.templates.get_template("_plan.html").render(plan=plans.public_plan(session, run)),
            }


@router.get("/runs/{slug}/events", include_in_schema=False)
async def events(request: Request, run: RunDep):
    feed: LiveFeed = request.app.state.feed
    slug = run.slug
    feed.check_capacity()

    async def stream():
        viewer = feed.subscribe(slug)  # here, not above: a stream that never starts must not leave a viewer
        try:
            while True:
                for name, data in (await viewer.next_events()).items():
                    yield {"event": name, "data": data}
        finally:
            feed.unsubscribe(slug, viewer)

    return EventSourceResponse(stream(), send_timeout=feed.settings.event_send_timeout)
