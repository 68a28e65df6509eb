"""What the OpenAPI document says about error answers, so that it matches what the portal sends.

Every error of the JSON API is ``{"detail": reason}`` with ``reason`` a sentence (``app/web/main.py`` maps the
errors), validation errors (422) included: FastAPI's default document promises a list there, so ``openapi``
below rewrites those entries to ``ErrorOut``. Routes name the other codes they can answer with the constants here
(``responses=``), and the device login its RFC 8628 / RFC 6749 body (``DeviceGrantErrorOut``).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

Responses = dict[int | str, dict[str, Any]]


class ErrorOut(BaseModel):
    """An error: ``detail`` says what went wrong, in words, and what to do about it."""

    detail: str


class DeviceGrantErrorOut(BaseModel):
    """A device-login poll that gets no credential (RFC 8628, 3.5; RFC 6749, 5.2)."""

    error: Literal["authorization_pending", "slow_down", "access_denied", "expired_token", "invalid_grant",
                   "invalid_request", "unsupported_grant_type"]
    error_description: str = Field(description="the same, in words")


BINARY = {"type": "string", "format": "binary"}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before trying again",
                               "schema": {"type": "integer", "minimum": 0}}}


def error(description: str, headers: dict | None = None) -> dict[str, Any]:
    answer: dict[str, Any] = {"model": ErrorOut, "description": description}
    if headers:
        answer["headers"] = headers
    return answer


# Any route that reads the database: a request that waits past DEDLOC_DB_POOL_TIMEOUT for a connection.
BUSY: Responses = {503: error("the database is busy; retry after Retry-After seconds", RETRY_AFTER)}
UNKNOWN_RUN: Responses = {404: error("no run by that slug")}
NEEDS_CREDENTIAL: Responses = {401: error("the `Authorization: Bearer` credential is missing, unknown or revoked")}
INVALID = "a path, query or body value breaks its rule: which one, and why"
# An operation that answers invalid input with another status than 422 says which (``openapi_extra``): its
# document then lists no 422. The device-login token endpoint answers 400, as OAuth's RFC 6749 (5.2) says.
VALIDATION_STATUS = "x-validation-error-status"


def document_validation_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """Point every 422 answer at ``ErrorOut`` (the portal's real body) instead of FastAPI's list of errors."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.setdefault("ErrorOut", ErrorOut.model_json_schema(ref_template="#/components/schemas/{model}"))
    for operation in (op for path in schema.get("paths", {}).values() for op in path.values()):
        if VALIDATION_STATUS in operation:
            operation.get("responses", {}).pop("422", None)
        answer = operation.get("responses", {}).get("422")
        if answer is None:
            continue
        content = answer.get("content", {}).get("application/json", {})
        if content.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
            answer["description"] = INVALID
            content["schema"] = {"$ref": "#/components/schemas/ErrorOut"}
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return schema


def install_openapi(app: FastAPI) -> None:
    """``app.openapi`` builds the document once, with validation errors documented as they are sent."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document_validation_errors(get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes,
                tags=app.openapi_tags, servers=app.servers))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
