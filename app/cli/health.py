"""Containers' health checks: ``dedloc coordinator-health --run SLUG`` and ``dedloc portal-health``.

Exit 0 when healthy; anything else is exit 1 with one line on stderr (Docker reserves exit 2), whatever went
wrong (the database or the portal unreachable, the run unknown). Both only read.

- coordinator: healthy while a coordinator of the run beat within ``coordinator_timeout`` and has not stopped
  since, the same test the status API (``GET /api/v1/runs/{slug}/status``) answers ``up`` with. No migration.
- portal: ``GET /healthz`` on this machine's ``DEDLOC_PORT`` answers 200.
"""

from __future__ import annotations

import sys

from sqlalchemy.exc import SQLAlchemyError

from app.core.config import Settings
from app.core.errors import DedlocError
from app.runs.status import RunStatus

HEALTHY, UNHEALTHY = 0, 1
WILDCARDS = ("", "0.0.0.0", "::")


def coordinator_health(settings: Settings, slug: str) -> int:
    try:
        status = read_status(settings, slug)
    except (DedlocError, SQLAlchemyError) as error:
        return unhealthy(f"cannot read run {slug!r}'s status: {one_line(error)}")
    if status.coordinators_up:
        return HEALTHY
    return unhealthy(why_down(status, settings.coordinator_timeout))


def read_status(settings: Settings, slug: str) -> RunStatus:
    from app.runs import registry
    from app.runs.status import run_status

    with read_session(settings) as session:
        return run_status(session, registry.get_run(session, slug), settings.coordinator_timeout)


def read_session(settings: Settings):
    """A session on the database as it is (the migrate step brings it up to date, not a health check)."""
    from app.core.database import one_session

    return one_session(settings.resolved_database_url, migrate_first=False)


def why_down(status: RunStatus, timeout: float) -> str:
    """In one line: no coordinator registered, the newest one stopped, or its heartbeat is too old."""
    if not status.coordinators:
        return f"no coordinator of run {status.slug!r} has started yet"
    newest = status.coordinators[0]  # newest heartbeat first
    if newest.stopped_at is not None:
        return f"the coordinator of run {status.slug!r} stopped at {newest.stopped_at:%Y-%m-%d %H:%M:%S} UTC"
    if newest.last_heartbeat is None:
        return f"no coordinator of run {status.slug!r} has sent a heartbeat yet"
    age = (status.checked_at - newest.last_heartbeat).total_seconds()
    return (f"run {status.slug!r}: its newest coordinator heartbeat is {age:.0f} s old, past the coordinator "
            f"timeout ({timeout:g} s, DEDLOC_COORDINATOR_TIMEOUT)")


def portal_health(settings: Settings, timeout: float = 4.0) -> int:
    import httpx

    host = "127.0.0.1" if settings.host in WILDCARDS else settings.host
    url = f"http://{host}:{settings.port}/healthz"
    try:
        code = httpx.get(url, timeout=timeout).status_code
    except httpx.HTTPError as error:
        return unhealthy(f"{url}: {type(error).__name__}: {one_line(error)}")
    return HEALTHY if code == 200 else unhealthy(f"{url} answered {code}")


def unhealthy(message: str) -> int:
    print(f"dedloc coordinator-health: {message}", file=sys.stderr)
    return UNHEALTHY


def one_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
