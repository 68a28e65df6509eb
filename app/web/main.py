"""The portal's FastAPI application: ``create_app(settings)``."""

from __future__ import annotations

import re
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import iter_route_contexts
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Mount, compile_path

from app.core.config import Settings
from app.core.database import make_engine, make_sessionmaker
from app.core.errors import DedlocError
from app.core.resources import static_dir, templates_dir
from app.core.secrets import secret_key
from app.identity.errors import DeviceGrantError, SignInRequired
from app.identity.oidc import make_oauth
from app.web import (
    api,
    auth_routes,
    docs,
    join,
    link_probe,
    live,
    me,
    metrics,
    organize,
    pages,
    peer_tokens,
    run_forms,
    stats,
)
from app.web.identity import csrf_token
from app.web.responses import install_openapi


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    engine = make_engine(settings.resolved_database_url, pool_size=settings.db_pool_size,
                         max_overflow=settings.db_max_overflow, pool_timeout=settings.db_pool_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await app.state.feed.close()
        engine.dispose()

    # /docs and /redoc come from app/web/docs.py, with vendored assets instead of FastAPI's CDN ones.
    app = FastAPI(title="dedloc", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.sessions = make_sessionmaker(engine)
    app.state.templates = Jinja2Templates(directory=templates_dir())
    app.state.feed = live.LiveFeed(app.state.sessions, app.state.templates, settings)
    app.state.registry = metrics.make_registry(app.state.sessions)
    app.mount("/static", StaticFiles(directory=static_dir()), name="static")
    # identity (app/identity/, app/web/auth_routes.py): signed session cookies, the OpenID Connect client, sign-in
    # redirects, form tokens
    app.add_middleware(auth_routes.SessionCookies, secret_key=secret_key(settings))
    app.state.oauth = make_oauth(settings)
    app.state.templates.env.globals["csrf_token"] = csrf_token
    # Starlette types a handler as taking any Exception, not the class it is registered for (starlette PR #2403)
    app.add_exception_handler(SignInRequired, auth_routes.sign_in_first)  # type: ignore[arg-type]
    app.add_exception_handler(DeviceGrantError, auth_routes.device_grant_refused)  # type: ignore[arg-type]
    app.include_router(auth_routes.router)
    # run_forms before pages: /runs/new is the form, not a run's dashboard
    for router in (docs.router, api.router, peer_tokens.router, link_probe.router, live.router, metrics.router,
                   join.router, organize.router, run_forms.router, me.router, stats.router, pages.router):
        app.include_router(router)
    app.add_api_route("/healthz", lambda: {"status": "ok"}, methods=["GET"], include_in_schema=False)
    add_error_handlers(app)
    install_openapi(app)
    return app


def wants_html(request: Request) -> bool:
    return not request.url.path.startswith("/api/") and "text/html" in request.headers.get("accept", "")


def allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method some route serves at this path (RFC 9110's ``Allow``): Starlette names only the methods of
    the first route that matched the path, and a path may have one route per method, in several routers."""
    table = getattr(app.state, "route_methods", None)
    if table is None:
        table = app.state.route_methods = []
        for context in iter_route_contexts(app.routes):
            route = context.original_route
            route_path = context.path or ""
            if isinstance(route, Mount) and isinstance(route.app, StaticFiles):
                table.append((re.compile(re.escape(route_path) + "/"), frozenset({"GET", "HEAD"})))
            elif route_path and (route_methods := getattr(route, "methods", None)):
                table.append((compile_path(route_path)[0], frozenset(route_methods)))
    path = request.scope.get("path", "")
    return sorted({method for pattern, methods in table if pattern.match(path) for method in methods})


def add_error_handlers(app: FastAPI) -> None:
    """One place maps errors to HTTP: JSON ``{"detail": reason}`` for the API, a page for browsers."""

    def respond(request: Request, status: int, detail) -> Response:
        if wants_html(request) and isinstance(detail, str):
            return app.state.templates.TemplateResponse(
                request, "error.html", {"status": status, "detail": detail}, status_code=status
            )
        return JSONResponse({"detail": detail}, status_code=status)

    @app.exception_handler(DedlocError)
    async def dedloc_error(request: Request, exc: DedlocError):
        response = respond(request, exc.status_code, str(exc))
        retry_after = getattr(exc, "retry_after", None)
        if retry_after:
            response.headers["Retry-After"] = str(int(retry_after + 0.999))
        return response

    @app.exception_handler(PoolTimeout)
    async def database_busy(request: Request, exc: PoolTimeout):
        response = respond(request, 503, "the portal's database is busy; retry in a few seconds")
        response.headers["Retry-After"] = "5"
        return response

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        response = respond(request, exc.status_code, exc.detail)
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            response.headers["Allow"] = ", ".join(allowed_methods(app, request))
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_input(request: Request, exc: RequestValidationError):
        reasons = [f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()]
        return respond(request, 422, "; ".join(reasons))
