"""A run's join page, and the downloads it points to: the worker wheel and a notebook."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, HTMLResponse, Response

from .. import distribution
from ..auth.deps import OptionalUser
from ..errors import NotFound
from .deps import RunDep, SettingsDep

router = APIRouter(include_in_schema=False)


def portal_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")


@router.get("/runs/{slug}/join", response_class=HTMLResponse)
def join_page(request: Request, run: RunDep, user: OptionalUser):
    url = portal_url(request)
    return request.app.state.templates.TemplateResponse(request, "join.html", {
        "run": run, "user": user,
        "install_line": distribution.install_line(url), "join_line": distribution.join_line(url, run.slug),
    })


@router.get("/runs/{slug}/join.ipynb")
def join_notebook(request: Request, run: RunDep):
    return Response(distribution.notebook_bytes(portal_url(request), run.slug, run.title),
                    media_type="application/x-ipynb+json",
                    headers={"Content-Disposition": f'attachment; filename="join-{run.slug}.ipynb"'})


@router.get("/downloads/{filename}")
async def worker_wheel(filename: str, settings: SettingsDep):
    if filename != distribution.wheel_name():
        raise NotFound(f"no download named {filename!r}; this portal serves {distribution.wheel_name()}")
    wheel = await run_in_threadpool(distribution.worker_wheel, settings.data_dir)
    return FileResponse(wheel, media_type="application/zip", filename=filename)
