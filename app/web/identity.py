"""Request dependencies for identity: the signed-in user (session cookie), the API user (bearer credential),
and the CSRF token that every form posted by a signed-in browser carries."""

from __future__ import annotations

import hmac
import secrets
from typing import Annotated, Optional

from fastapi import Depends, Form, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.identity import accounts
from app.identity.accounts import is_organizer
from app.identity.errors import FormRefused, SignInRequired, Unauthorized
from app.identity.models import User
from app.web.deps import SessionDep, SettingsDep

__all__ = ["ApiUser", "BearerSecret", "CsrfChecked", "CurrentUser", "OptionalUser", "csrf_token", "is_organizer"]


def optional_user(request: Request, session: SessionDep) -> Optional[User]:
    user_id = request.session.get("uid")
    return accounts.get_user(session, user_id) if isinstance(user_id, int) else None


OptionalUser = Annotated[Optional[User], Depends(optional_user)]


def current_user(user: OptionalUser) -> User:
    if user is None:
        raise SignInRequired("sign in first")
    return user


CurrentUser = Annotated[User, Depends(current_user)]

_bearer = HTTPBearer(auto_error=False, description="the credential `dedloc-worker login` stored")


def bearer_secret(credentials: Annotated[Optional[HTTPAuthorizationCredentials], Depends(_bearer)]) -> str:
    if credentials is None or not credentials.credentials:
        raise Unauthorized("missing API credential: send `Authorization: Bearer <credential>`; "
                           "`dedloc-worker login <portal-url>` gets one")
    return credentials.credentials


BearerSecret = Annotated[str, Depends(bearer_secret)]


def api_user(session: SessionDep, settings: SettingsDep, secret: BearerSecret) -> User:
    return accounts.authenticate(session, secret, settings.api_credential_lifetime)


ApiUser = Annotated[User, Depends(api_user)]


def csrf_token(request: Request) -> str:
    """This session's form token, created on first use."""
    token = request.session.get("csrf")
    if not token:
        token = request.session["csrf"] = secrets.token_urlsafe(32)
    return token


def check_csrf(request: Request, csrf: Annotated[str, Form()] = "") -> None:
    expected = request.session.get("csrf")
    if not expected or not hmac.compare_digest(expected.encode(), csrf.encode()):
        raise FormRefused("this form expired or was sent from another site; reload the page and try again")


CsrfChecked = Depends(check_csrf)
