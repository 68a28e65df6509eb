"""A real, minimal OpenID Connect provider for tests, and a way to serve any ASGI app on loopback.

The provider publishes a discovery document and a JWKS (one RSA key per test session), auto-approves one
configured user at /authorize, and at /token checks the client secret, the redirect URI and the PKCE
``code_verifier`` (S256) before it issues a signed ID token. It can be told to misbehave: a wrong nonce, an
expired ID token, a wrong audience, a token signed with a key it never published, or ``error=access_denied``.
This is the one seam where the outside world (Hugging Face) is replaced: the portal only sees another issuer URL.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import socket
import threading
import time
from typing import Optional
from urllib.parse import urlencode

import uvicorn
from joserfc import jwt
from joserfc.jwk import RSAKey
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse
from starlette.routing import Route

MODES = (None, "wrong_nonce", "expired", "wrong_audience", "unknown_key", "access_denied")


class LoopbackServer:
    """Serve an ASGI app with uvicorn in a thread on a free loopback port, for the length of a ``with``."""

    def __init__(self, app):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", ws="none", lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> "LoopbackServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.socket.close()
        assert not self.thread.is_alive(), f"the server on {self.url} did not stop"


def _b64url_sha256(text: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()


class OidcProvider:
    """The provider's state; ``app`` is its ASGI application, ``issuer`` is set once it is served."""

    def __init__(self, key: RSAKey, client_id: str, client_secret: str, username: str = "alice",
                 subject: str = "subject-alice"):
        self.key, self.client_id, self.client_secret = key, client_id, client_secret
        self.username, self.subject = username, subject
        # As on Hugging Face: listed in userinfo (not in the ID token), and only to apps granted `read-org`.
        self.organizations: tuple = ()
        self.rogue_key = RSAKey.generate_key(2048, parameters={"kid": key.kid})  # same kid, never published
        self.issuer = ""
        self.mode: Optional[str] = None
        self.codes: dict[str, dict] = {}
        self.access_tokens: dict[str, tuple[str, str]] = {}
        self.app = Starlette(routes=[
            Route("/.well-known/openid-configuration", self.discovery),
            Route("/jwks", self.jwks),
            Route("/authorize", self.authorize),
            Route("/token", self.token, methods=["POST"]),
            Route("/userinfo", self.userinfo),
        ])

    def reset(self, mode: Optional[str] = None) -> None:
        assert mode in MODES, mode
        self.mode = mode
        self.organizations = ()
        self.codes.clear()
        self.access_tokens.clear()

    async def discovery(self, request: Request):
        return JSONResponse({
            "issuer": self.issuer,
            "authorization_endpoint": f"{self.issuer}/authorize",
            "token_endpoint": f"{self.issuer}/token",
            "userinfo_endpoint": f"{self.issuer}/userinfo",
            "jwks_uri": f"{self.issuer}/jwks",
            "response_types_supported": ["code"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": ["RS256"],
            "code_challenge_methods_supported": ["S256"],
            "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post"],
            "scopes_supported": ["openid", "profile"],
        })

    async def jwks(self, request: Request):
        return JSONResponse({"keys": [self.key.as_dict(private=False, use="sig", alg="RS256")]})

    async def authorize(self, request: Request):
        query = request.query_params
        if query.get("client_id") != self.client_id or query.get("response_type") != "code":
            return JSONResponse({"error": "invalid_request", "error_description": "unknown client"}, 400)
        if query.get("code_challenge_method") != "S256" or not query.get("code_challenge"):
            return JSONResponse({"error": "invalid_request", "error_description": "PKCE (S256) is required"}, 400)
        if "openid" not in query.get("scope", "").split() or not query.get("nonce") or not query.get("state"):
            return JSONResponse({"error": "invalid_request", "error_description": "openid, nonce, state"}, 400)
        redirect_uri = query["redirect_uri"]
        if self.mode == "access_denied":
            answer = {"error": "access_denied", "error_description": "The user declined", "state": query["state"]}
            return RedirectResponse(f"{redirect_uri}?{urlencode(answer)}", 302)
        code = secrets.token_urlsafe(16)
        self.codes[code] = {"challenge": query["code_challenge"], "nonce": query["nonce"],
                            "redirect_uri": redirect_uri, "scope": query.get("scope", "")}
        return RedirectResponse(f"{redirect_uri}?{urlencode({'code': code, 'state': query['state']})}", 302)

    async def token(self, request: Request):
        form = await request.form()
        if not self._client_authenticated(request, form):
            return JSONResponse({"error": "invalid_client"}, 401)
        grant = self.codes.pop(form.get("code", ""), None)  # a code works once
        if grant is None or form.get("grant_type") != "authorization_code":
            return JSONResponse({"error": "invalid_grant", "error_description": "unknown or used code"}, 400)
        if form.get("redirect_uri") != grant["redirect_uri"]:
            return JSONResponse({"error": "invalid_grant", "error_description": "redirect_uri differs"}, 400)
        if _b64url_sha256(form.get("code_verifier", "")) != grant["challenge"]:
            return JSONResponse({"error": "invalid_grant", "error_description": "PKCE verification failed"}, 400)
        access_token = secrets.token_urlsafe(16)
        self.access_tokens[access_token] = (self.subject, grant["scope"])
        return JSONResponse({"access_token": access_token, "token_type": "Bearer", "expires_in": 3600,
                             "scope": grant["scope"], "id_token": self.id_token(grant["nonce"])})

    def _client_authenticated(self, request: Request, form) -> bool:
        header = request.headers.get("authorization", "")
        if header.startswith("Basic "):
            client_id, _, secret = base64.b64decode(header[6:]).decode().partition(":")
        else:
            client_id, secret = form.get("client_id"), form.get("client_secret")
        return client_id == self.client_id and secrets.compare_digest(secret or "", self.client_secret)

    def id_token(self, nonce: str) -> str:
        now = int(time.time())
        claims = {"iss": self.issuer, "sub": self.subject, "aud": self.client_id, "iat": now, "exp": now + 300,
                  "nonce": nonce, "name": self.username.title()}
        if self.mode == "wrong_nonce":
            claims["nonce"] = "not-the-nonce-of-this-sign-in"
        elif self.mode == "expired":
            claims.update(iat=now - 1200, exp=now - 600)
        elif self.mode == "wrong_audience":
            # azp naming this portal does not make up for an audience without it (OpenID Connect Core, 3.1.3.7)
            claims.update(aud="some-other-application", azp=self.client_id)
        key = self.rogue_key if self.mode == "unknown_key" else self.key
        return jwt.encode({"alg": "RS256", "kid": key.kid}, claims, key)

    async def userinfo(self, request: Request):
        token = request.headers.get("authorization", "").removeprefix("Bearer ")
        if token not in self.access_tokens:
            return JSONResponse({"error": "invalid_token"}, 401)
        subject, scope = self.access_tokens[token]
        info = {"sub": subject, "preferred_username": self.username, "name": self.username.title()}
        if "read-org" in scope.split():
            info["orgs"] = [{"sub": f"org-{name}", "preferred_username": name, "name": name.title()}
                            for name in self.organizations]
        return JSONResponse(info)
