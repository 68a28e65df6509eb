"""Interactive API docs, ``/docs`` (Swagger UI 5.35.0) and ``/redoc`` (ReDoc 2.5.4), from files the portal serves
itself (``app/static/vendor/``): they work on a network that reaches nothing but the portal. FastAPI's own pages
load both from a CDN, so ``create_app`` turns those off (``docs_url=None, redoc_url=None``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse

router = APIRouter(include_in_schema=False)
VENDOR = "/static/vendor"
# Nothing from elsewhere, whatever the bundles ask for: ReDoc 2.5.4 puts an image from its CDN in its sidebar
# (and hides it when that fails). The pages' own inline script and the bundles' inline styles are allowed.
SAME_ORIGIN_ONLY = {"Content-Security-Policy": "default-src 'self'; script-src 'self' 'unsafe-inline'; "
                                               "style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                                               "worker-src 'self' blob:; connect-src 'self'"}


def under_root(request: Request, path: str) -> str:
    """``path`` below the portal's root path (behind a proxy that serves it under a prefix)."""
    return request.scope.get("root_path", "").rstrip("/") + path


@router.get("/docs", response_class=HTMLResponse)
def swagger_ui(request: Request) -> HTMLResponse:
    page = get_swagger_ui_html(
        openapi_url=under_root(request, request.app.openapi_url), title=f"{request.app.title} API",
        swagger_js_url=under_root(request, f"{VENDOR}/swagger-ui-bundle.js"),
        swagger_css_url=under_root(request, f"{VENDOR}/swagger-ui.css"),
        swagger_favicon_url=under_root(request, f"{VENDOR}/swagger-ui-favicon-32x32.png"),
        # Swagger UI would otherwise send the document to validator.swagger.io for a badge.
        swagger_ui_parameters={"validatorUrl": None},
    )
    page.headers.update(SAME_ORIGIN_ONLY)
    return page


@router.get("/redoc", response_class=HTMLResponse)
def redoc(request: Request) -> HTMLResponse:
    page = get_redoc_html(
        openapi_url=under_root(request, request.app.openapi_url), title=f"{request.app.title} API",
        redoc_js_url=under_root(request, f"{VENDOR}/redoc.standalone.js"),
        redoc_favicon_url=under_root(request, f"{VENDOR}/swagger-ui-favicon-32x32.png"),
        with_google_fonts=False,
    )
    page.headers.update(SAME_ORIGIN_ONLY)
    return page
