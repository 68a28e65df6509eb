"""Errors of sign-in and API credentials. ``app/web/main.py`` maps every ``DedlocError`` to HTTP (a page for
browsers, ``{"detail": reason}`` for the API); ``SignInRequired`` becomes a redirect to the sign-in page for
pages, and ``DeviceGrantError`` the RFC 8628 JSON body, both in ``app/web/auth_routes.py``.

    DedlocError
    └── AuthError
        ├── SignInRequired     no signed-in user (HTTP 401, or a redirect to /signin for pages)
        ├── Unauthorized       a missing, unknown or revoked API credential (HTTP 401)
        ├── SignInRefused      the provider, the ID token or the configuration refused a sign-in (4xx, 502)
        ├── FormRefused        a form without this session's CSRF token (HTTP 403)
        ├── UserCodeRefused    a user code that names no pending device login (404 unknown, 400 expired/decided)
        └── DeviceGrantError   a device-login poll that gets no credential (HTTP 400, RFC 8628 error code)
"""

from __future__ import annotations

from typing import Optional

from app.core.errors import DedlocError


class AuthError(DedlocError):
    status_code = 401

    def __init__(self, message: str, status_code: Optional[int] = None):
        super().__init__(message)
        if status_code is not None:
            self.status_code = status_code


class SignInRequired(AuthError):
    status_code = 401


class Unauthorized(AuthError):
    status_code = 401


class SignInRefused(AuthError):
    status_code = 400


class FormRefused(AuthError):
    status_code = 403


class UserCodeRefused(AuthError):
    status_code = 400


class DeviceGrantError(AuthError):
    """``error`` is one of RFC 8628's codes (authorization_pending, slow_down, access_denied, expired_token) or
    RFC 6749's (invalid_grant, invalid_request, unsupported_grant_type)."""

    status_code = 400

    def __init__(self, error: str, description: str):
        super().__init__(description)
        self.error = error
