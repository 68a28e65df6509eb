"""The new-run form: portal organizers (DEDLOC_ORGANIZERS) create a run on the web, uploading its data files."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

from dedloc_common.contract import CheckpointOptions, OptimizerOptions
from dedloc_common.tasks import BUILT_IN, MASKED_LM
from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse

from app.core.errors import Forbidden, Invalid
from app.identity.models import User
from app.runs import registry
from app.web.deps import SessionDep, SettingsDep
from app.web.form_values import json_object, pretty, whole
from app.web.identity import CurrentUser, check_csrf, is_organizer
from app.web.uploads import read_multipart, size_text

router = APIRouter(include_in_schema=False)

# A small ALBERT masked-LM on one uploaded text file, its tokenizer trained by the portal at creation: the demo's
# model (app/cli/demo.py DEMO_MODEL; a test keeps them equal), which a CPU trains.
EXAMPLE_MODEL = {"model_type": "albert", "embedding_size": 64, "hidden_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "intermediate_size": 256, "max_position_embeddings": 128}
EXAMPLE_TASK = {"model": EXAMPLE_MODEL, "data": {"files": ["train.txt"]}, "tokenizer": {"train": {"vocab_size": 4000}},
                "sequence_length": 64, "eval_samples": 128}


def creator(user: CurrentUser, settings: SettingsDep) -> User:
    if not is_organizer(settings, user):
        raise Forbidden(f"{user.username} may not create runs: only the portal's organizers (DEDLOC_ORGANIZERS) do")
    return user


Creator = Annotated[User, Depends(creator)]


def defaults() -> dict[str, str]:
    return {"slug": "", "title": "", "task": MASKED_LM, "task_options": pretty(EXAMPLE_TASK), "batch_size": "16",
            "target_batch_size": "4096", "optimizer": pretty(OptimizerOptions().model_dump()),
            "checkpoints": pretty(CheckpointOptions().model_dump()), "target_epochs": ""}


def render(request: Request, settings, values: dict[str, str], error: str = "", status_code: int = 200):
    return request.app.state.templates.TemplateResponse(request, "run_new.html", {
        "values": values, "error": error, "tasks": BUILT_IN, "max_upload": size_text(settings.max_upload_bytes),
    }, status_code=status_code)


@router.get("/runs/new", response_class=HTMLResponse)
def new_run_page(request: Request, user: Creator, settings: SettingsDep):
    return render(request, settings, defaults())


@router.post("/runs/new")
async def create_run(request: Request, user: Creator, settings: SettingsDep, session: SessionDep):
    username = user.username
    session.close()  # an upload may take minutes: hold no pooled database connection meanwhile
    scratch = Path(settings.data_dir) / "uploads"  # the data folder's disk: /tmp may be memory
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as folder:
        form = await read_multipart(request, Path(folder), settings.max_upload_bytes)
        check_csrf(request, form.fields.get("csrf", ""))
        values = {**{key: "" for key in defaults()}, **form.fields}
        try:
            # stores the files and may train a tokenizer: seconds of CPU, off the event loop
            slug = await run_in_threadpool(create_from_form, request.app.state.sessions, settings, username,
                                           values, form.files)
        except Invalid as e:
            return render(request, settings, values, str(e), status_code=422)
    return RedirectResponse(f"/runs/{slug}", status_code=303)


def create_from_form(sessions, settings, username: str, values: dict[str, str], files: dict[str, Path]) -> str:
    """Create the run the form describes (the creator becomes its organizer); ``Invalid`` naming the option."""
    if values["task"] not in BUILT_IN:
        raise Invalid(f"task: use one of {', '.join(BUILT_IN)}")
    options = dict(
        slug=values["slug"].strip(), title=values["title"].strip() or values["slug"].strip(), task=values["task"],
        task_options=json_object(values["task_options"], "task_options"),
        batch_size=whole(values["batch_size"], "batch_size"),
        target_batch_size=whole(values["target_batch_size"], "target_batch_size"),
        optimizer=json_object(values["optimizer"], "optimizer"),
        checkpoints=json_object(values["checkpoints"], "checkpoints"),
        target_epochs=whole(values["target_epochs"], "target_epochs", optional=True),
    )
    with sessions() as session:
        return registry.create_run_with_files(session, settings.data_dir, files, created_by=username, **options).slug
