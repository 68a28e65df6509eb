"""Sign-in (OpenID Connect, or the loopback-only development sign-in), sign-out, the device login (RFC 8628)
for workers, and who an API credential belongs to."""

from __future__ import annotations

import ipaddress
import secrets
from typing import Annotated, Any, Literal, Optional
from urllib.parse import quote

from dedloc_common.contract import API_PREFIX
from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.middleware.sessions import SessionMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from app.core.clock import as_utc, utcnow
from app.core.config import Settings
from app.identity import accounts, device, oidc
from app.identity.device import DevicePolicy
from app.identity.errors import DeviceGrantError, SignInRefused, SignInRequired, UserCodeRefused
from app.identity.models import User
from app.web.deps import SessionDep, SettingsDep
from app.web.identity import ApiUser, BearerSecret, CsrfChecked, CurrentUser, OptionalUser, csrf_token
from app.web.responses import BUSY, NEEDS_CREDENTIAL, RETRY_AFTER, VALIDATION_STATUS, DeviceGrantErrorOut, error

router = APIRouter()
DEVICE_GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"
NO_STORE = {"Cache-Control": "no-store", "Pragma": "no-cache"}
# Headers a reverse proxy adds: a request carrying one did not come from this machine's own browser.
PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-real-ip")


class SessionCookies:
    """Starlette's signed session cookie (HttpOnly, SameSite=lax), marked Secure on requests served over https."""

    def __init__(self, app: ASGIApp, secret_key: str, max_age: int = 14 * 24 * 3600):
        options: dict[str, Any] = dict(secret_key=secret_key, session_cookie="dedloc_session", max_age=max_age,
                                       same_site="lax")
        self.plain = SessionMiddleware(app, **options)
        self.secure = SessionMiddleware(app, https_only=True, **options)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        middleware = self.secure if scope.get("scheme") in ("https", "wss") else self.plain
        await middleware(scope, receive, send)


async def sign_in_first(request: Request, exc: SignInRequired):
    """Pages send a visitor without a session to the sign-in page and back; the API answers 401."""
    if request.url.path.startswith("/api/"):
        return JSONResponse({"detail": str(exc)}, status_code=401)
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/signin?next={quote(target, safe='')}", status_code=303)


def render(request: Request, template: str, status_code: int = 200, **context):
    return request.app.state.templates.TemplateResponse(request, template, context, status_code=status_code)


def safe_next(target: Optional[str]) -> str:
    """Only paths on this portal: an open redirect would lend the portal's name to phishing."""
    if target and target.startswith("/") and not target.startswith(("//", "/\\")) and target.isprintable():
        return target
    return "/"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def dev_sign_in_refusal(settings: Settings, request: Request) -> Optional[str]:
    """Why the development sign-in is not offered here, or None when it is."""
    if settings.oidc_client_id:
        return f"this portal signs in through {oidc.provider_name(settings)}; the development sign-in is off"
    if not is_loopback(settings.host):
        return (f"the development sign-in is for local use only, and this portal listens on {settings.host}, "
                "not on a loopback address; configure an OpenID Connect provider (DEDLOC_OIDC_CLIENT_ID, "
                "DEDLOC_OIDC_CLIENT_SECRET, DEDLOC_OIDC_ISSUER)")
    if any(name in request.headers for name in PROXY_HEADERS):
        return ("the development sign-in is for local use only, and this request came through a proxy; "
                "configure an OpenID Connect provider (DEDLOC_OIDC_CLIENT_ID, DEDLOC_OIDC_CLIENT_SECRET)")
    return None


def start_session(request: Request, user: User) -> None:
    request.session.clear()  # nothing from before the sign-in carries over
    request.session.update(uid=user.id, username=user.username, csrf=secrets.token_urlsafe(32))


# sign-in pages -------------------------------------------------------------------------------------------------

@router.get("/signin", response_class=HTMLResponse, include_in_schema=False)
def signin_page(request: Request, settings: SettingsDep, user: OptionalUser, next: Optional[str] = None):
    provider = oidc.provider_name(settings) if request.app.state.oauth else None
    refusal = None if provider else dev_sign_in_refusal(settings, request)
    return render(request, "signin.html", 403 if refusal else 200, provider=provider, refusal=refusal,
                  next=safe_next(next), user=user, csrf=csrf_token(request))


def dev_sign_in_offered(request: Request, settings: SettingsDep) -> None:
    refusal = dev_sign_in_refusal(settings, request)
    if refusal:
        raise SignInRefused(refusal, 403)


# The refusal comes first: it tells why, whatever the form carried.
@router.post("/signin/dev", include_in_schema=False, dependencies=[Depends(dev_sign_in_offered), CsrfChecked])
def dev_sign_in(request: Request, session: SessionDep, username: Annotated[str, Form(max_length=100)],
                next: Annotated[str, Form()] = "/"):
    start_session(request, accounts.sign_in_locally(session, username=username.strip()))
    return RedirectResponse(safe_next(next), status_code=303)


@router.get("/signin/oidc", include_in_schema=False)
async def oidc_sign_in(request: Request, next: Optional[str] = None):
    if request.app.state.oauth is None:
        raise SignInRefused("no OpenID Connect provider is configured on this portal (DEDLOC_OIDC_CLIENT_ID)", 404)
    request.session["next"] = safe_next(next)
    redirect_uri = str(request.url_for("oidc_callback"))
    return await oidc.redirect_to_provider(request.app.state.oauth, request, redirect_uri)


@router.get("/signin/oidc/callback", name="oidc_callback", include_in_schema=False)
async def oidc_callback(request: Request, settings: SettingsDep, session: SessionDep):
    oauth = request.app.state.oauth
    try:
        if oauth is None:
            raise SignInRefused("no OpenID Connect provider is configured on this portal", 404)
        identity = await oidc.identity_from_callback(oauth, request, settings)
        user = await run_in_threadpool(accounts.sign_in_with_provider, session, issuer=identity.issuer,
                                       subject=identity.subject, username=identity.username,
                                       organizations=identity.organizations)
    except SignInRefused as refused:
        return render(request, "signin.html", refused.status_code, failure=str(refused), provider=None,
                      refusal=None, next="/", user=None, csrf=csrf_token(request))
    target = request.session.get("next", "/")
    start_session(request, user)
    return RedirectResponse(safe_next(target), status_code=303)


@router.post("/signout", include_in_schema=False, dependencies=[CsrfChecked])
def sign_out(request: Request):
    request.session.clear()
    return RedirectResponse("/", status_code=303)


# device login: the worker's side (RFC 8628, 3.1-3.5) ------------------------------------------------------------

def device_policy(settings: SettingsDep) -> DevicePolicy:
    """Code lifetime, poll interval and rate; tests override this dependency (``app.dependency_overrides``)."""
    return DevicePolicy(per_address_per_minute=settings.device_logins_per_minute)


class DeviceCodeOut(BaseModel):
    """A started device login (RFC 8628, 3.2)."""

    device_code: str = Field(description="what the worker polls the token endpoint with; never shown")
    user_code: str = Field(description="what the person enters on verification_uri")
    verification_uri: str
    verification_uri_complete: str = Field(description="verification_uri with the user code filled in")
    expires_in: int = Field(description="seconds the codes stay valid")
    interval: int = Field(description="seconds to wait between two polls")


class DeviceTokenForm(BaseModel):
    """A poll of the token endpoint (RFC 8628, 3.4)."""

    grant_type: Literal["urn:ietf:params:oauth:grant-type:device_code"]
    device_code: str = Field(min_length=1, max_length=200, description="from the device code endpoint")
    client_id: Optional[str] = Field(None, max_length=200, description="accepted and not checked: a public client")


class DeviceTokenOut(BaseModel):
    """The credential of an approved device login, handed out once."""

    access_token: str = Field(description="send it as `Authorization: Bearer <access_token>`")
    token_type: Literal["bearer"]
    username: str


class DeviceGrantRoute(APIRoute):
    """A token endpoint answers malformed requests as RFC 6749 (5.2) says: 400 ``invalid_request`` or
    ``unsupported_grant_type`` with the OAuth error body, not FastAPI's 422."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def answer(request: Request):
            try:
                return await handler(request)
            except RequestValidationError as invalid:
                problems = invalid.errors()
                if any(p["loc"][-1:] == ("grant_type",) and p["type"] == "literal_error" for p in problems):
                    raise DeviceGrantError("unsupported_grant_type",
                                           f"grant_type must be {DEVICE_GRANT_TYPE}") from None
                reasons = "; ".join(f"{p['loc'][-1]}: {p['msg']}" for p in problems)
                raise DeviceGrantError("invalid_request", reasons) from None

        return answer


async def device_grant_refused(request: Request, exc: DeviceGrantError):
    return JSONResponse({"error": exc.error, "error_description": str(exc)}, status_code=400, headers=NO_STORE)


@router.post(f"{API_PREFIX}/device/code", tags=["device login"], response_model=DeviceCodeOut,
             responses={400: error("a body that cannot be read as a form (for example multipart without its boundary)"),
                        429: error("past the device logins one address may start in a minute", RETRY_AFTER),
                        **BUSY})
def device_code(request: Request, session: SessionDep, policy: Annotated[DevicePolicy, Depends(device_policy)],
                client_name: Annotated[Optional[str], Form(max_length=200)] = None):
    """Start a device login: show ``user_code`` and ``verification_uri`` to the person, then poll the token
    endpoint with ``device_code`` every ``interval`` seconds. 429 with Retry-After past the per-address rate."""
    address = request.client.host if request.client else None  # behind a proxy: uvicorn reads X-Forwarded-For
    started = device.start_device_login(session, policy=policy, client_name=client_name, requested_from=address)
    verification_uri = str(request.url_for("device_page"))
    return JSONResponse(DeviceCodeOut(
        device_code=started.device_code, user_code=started.user_code, verification_uri=verification_uri,
        verification_uri_complete=f"{verification_uri}?user_code={started.user_code}",
        expires_in=started.expires_in, interval=started.interval,
    ).model_dump(), headers=NO_STORE)


def device_token(session: SessionDep, form: Annotated[DeviceTokenForm, Form()]):
    """Poll a device login: 200 ``{access_token, token_type, username}`` once approved, otherwise 400
    ``{error, error_description}`` with RFC 8628's codes (``authorization_pending`` until the person decides,
    ``slow_down`` when polled faster than ``interval``, ``access_denied``, ``expired_token``), or RFC 6749's
    (``invalid_grant``: unknown or used code; ``invalid_request``, ``unsupported_grant_type``: a malformed poll)."""
    grant = device.poll_device_login(session, device_code=form.device_code)
    return JSONResponse(DeviceTokenOut(access_token=grant.access_token, token_type="bearer",
                                       username=grant.username).model_dump(), headers=NO_STORE)


router.add_api_route(
    f"{API_PREFIX}/device/token", device_token, methods=["POST"], tags=["device login"],
    response_model=DeviceTokenOut, route_class_override=DeviceGrantRoute,
    responses={400: {"model": DeviceGrantErrorOut, "description": "no credential (yet): the RFC's error code"},
               **BUSY},
    openapi_extra={VALIDATION_STATUS: 400},
)


class WhoAmI(BaseModel):
    username: str
    organizer: bool = Field(description="may create runs on this portal")


class Revoked(BaseModel):
    revoked: bool = Field(description="false when the credential was revoked already")
    username: str


@router.get(f"{API_PREFIX}/me", tags=["device login"], response_model=WhoAmI,
            responses={**NEEDS_CREDENTIAL, **BUSY})
def me(user: ApiUser, settings: SettingsDep):
    """Who the bearer credential belongs to."""
    return {"username": user.username, "organizer": accounts.is_organizer(settings, user)}


@router.delete(f"{API_PREFIX}/me/credential", tags=["device login"], response_model=Revoked,
               responses={**NEEDS_CREDENTIAL, **BUSY})
def revoke_credential(user: ApiUser, secret: BearerSecret, session: SessionDep):
    """Revoke the bearer credential of this request (what `dedloc-worker logout` may call)."""
    return {"revoked": accounts.revoke_credential(session, secret), "username": user.username}


# device login: the person's side -------------------------------------------------------------------------------

@router.get("/device", name="device_page", response_class=HTMLResponse, include_in_schema=False)
def device_page(request: Request, user: CurrentUser, session: SessionDep,
                user_code: Annotated[Optional[str], Query(max_length=50)] = None):
    if not user_code:
        return render(request, "device.html", step="enter", user=user, csrf=csrf_token(request))
    try:
        pending = device.pending_device_code(session, user_code)
    except UserCodeRefused as refused:
        return render(request, "device.html", refused.status_code, step="enter", error=str(refused),
                      user_code=user_code, user=user, csrf=csrf_token(request))
    asked = max(0, int((utcnow() - as_utc(pending.created_at)).total_seconds()))
    return render(request, "device.html", step="confirm", pending=pending, asked_seconds_ago=asked, user=user,
                  csrf=csrf_token(request))


@router.post("/device", response_class=HTMLResponse, include_in_schema=False, dependencies=[CsrfChecked])
def device_decision(request: Request, user: CurrentUser, session: SessionDep,
                    user_code: Annotated[str, Form(max_length=50)], decision: Annotated[str, Form()]):
    if decision not in ("approve", "deny"):
        raise UserCodeRefused("the decision must be approve or deny", 422)
    try:
        decided = device.decide_device_login(session, user_code=user_code, user=user, approve=decision == "approve")
    except UserCodeRefused as refused:
        return render(request, "device.html", refused.status_code, step="enter", error=str(refused),
                      user_code=user_code, user=user, csrf=csrf_token(request))
    return render(request, "device.html", step="done", decided=decided, user=user, csrf=csrf_token(request))
