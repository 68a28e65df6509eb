"""The stats dumps under stable URLs: ``/stats/users.json.gz``, ``users.csv.gz``, ``teams.json.gz``,
``teams.csv.gz``, served from ``data_dir/stats`` (written by ``dedloc export-stats`` and the coordinator)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from fastapi.responses import FileResponse

from app.core.errors import NotFound
from app.credit.stats_export import FILES, stats_dir
from app.web.deps import SettingsDep
from app.web.responses import BINARY, error

router = APIRouter(tags=["stats"])


@router.get("/stats/{name}", response_class=FileResponse,
            responses={200: {"content": {"application/gzip": {"schema": BINARY}},
                             "description": "a gzip file"},
                       404: error("no such stats file, or none exported yet")})
def stats_file(settings: SettingsDep, name: Annotated[str, Path(max_length=40)]):
    """Per-user and per-team totals across runs and per run, users hidden from public boards left out;
    refreshed once a day."""
    if name not in FILES:
        raise NotFound(f"no stats file named {name!r}; there are {', '.join(FILES)}")
    path = stats_dir(settings.data_dir) / name
    if not path.is_file():
        raise NotFound("no stats exported yet: they appear within a day of the coordinator's start, "
                       "or run `dedloc export-stats`")
    return FileResponse(path, media_type="application/gzip", filename=name)
