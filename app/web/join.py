"""A run's join page, and the downloads it points to: the volunteer wheels and a notebook."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from app.credit import volunteers
from app.runs import distribution
from app.runs.memory import measured_needs
from app.web.deps import RunDep, SessionDep
from app.web.identity import OptionalUser

router = APIRouter(include_in_schema=False)


def portal_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")


@router.get("/runs/{slug}/join", response_class=HTMLResponse)
def join_page(request: Request, run: RunDep, user: OptionalUser, session: SessionDep):
    url = portal_url(request)
    # The signed-in volunteer's own peers in this run: how the dial-back decided each one's mode.
    peers = [p for p in volunteers.own_peers(session, user.username) if p.run == run.slug] if user else []
    return request.app.state.templates.TemplateResponse(request, "join.html", {
        "run": run, "user": user, "peers": peers, "needs": measured_needs(session, run),
        "adapter": bool((run.task_options or {}).get("adapter")),
        "install_line": distribution.install_line(url), "join_line": distribution.join_line(url, run.slug),
    })


@router.get("/runs/{slug}/join.ipynb")
def join_notebook(request: Request, run: RunDep):
    return Response(distribution.notebook_bytes(portal_url(request), run.slug, run.title),
                    media_type="application/x-ipynb+json",
                    headers={"Content-Disposition": f'attachment; filename="join-{run.slug}.ipynb"'})


@router.get("/downloads/{filename}")
def volunteer_wheel(filename: str):
    return FileResponse(distribution.wheel(filename), media_type="application/zip", filename=filename)
