"""Request dependencies: settings, a database session, and the run named in the path."""

from __future__ import annotations

from typing import Annotated, Iterator

from fastapi import Depends, Path, Request
from sqlalchemy.orm import Session

from app.core.config import Settings
from app.models import Run
from app.runs import registry


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
# Closed when the handler returns, before the response is sent: a streaming response holds no connection.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def valid_run(session: SessionDep, slug: Annotated[str, Path(max_length=64)]) -> Run:
    return registry.get_run(session, slug)


RunDep = Annotated[Run, Depends(valid_run)]
