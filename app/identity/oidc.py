"""Sign-in through an OpenID Connect provider (Hugging Face by default) with authlib: the provider's discovery
document, authorization code with PKCE (S256), state and nonce checked, and the ID token's signature, issuer,
audience and expiry verified. Every way a sign-in can fail becomes ``SignInRefused`` with the reason in words."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlsplit

import httpx
from joserfc.errors import BadSignatureError, ClaimError, ExpiredTokenError, JoseError
from starlette.requests import Request
from starlette.responses import Response

with warnings.catch_warnings():
    # authlib 1.9 warns once, on import, that it would rather drive httpx2 than httpx. httpx is the HTTP client
    # of the whole project (the worker ships with it), and authlib supports it.
    import authlib.deprecate  # noqa: F401  (its import puts an "always" filter first: ours must go after it)

    warnings.filterwarnings("ignore", "The httpx module is deprecated", DeprecationWarning)
    from authlib.integrations.base_client.errors import MismatchingStateError, OAuthError
    from authlib.integrations.starlette_client import OAuth

from app.core.config import Settings
from app.identity.errors import SignInRefused

try:  # authlib drives httpx2 where it is installed (huggingface_hub brings it beside the coordinator), else httpx
    import httpx2

    TRANSPORT_ERRORS: tuple[type[Exception], ...] = (httpx.HTTPError, httpx2.HTTPError)
except ImportError:
    TRANSPORT_ERRORS = (httpx.HTTPError,)
# What both sign-in steps answer with 502: the provider could not be reached, or what it sent could not be used.
PROVIDER_ERRORS: tuple[type[Exception], ...] = (*TRANSPORT_ERRORS, ValueError, RuntimeError)

NAME = "oidc"
# Seconds of clock difference tolerated between this portal and the provider on exp, iat and nbf.
LEEWAY = 60


@dataclass(frozen=True)
class Identity:
    issuer: str
    subject: str
    username: str
    organizations: tuple = ()  # Hugging Face's `orgs` claim (with its read-org scope), for org-only runs


def make_oauth(settings: Settings) -> Optional[OAuth]:
    """The provider's client, or None when no client id is configured (only the development sign-in then)."""
    if not settings.oidc_client_id:
        return None
    oauth = OAuth()
    oauth.register(
        NAME,
        client_id=settings.oidc_client_id,
        client_secret=settings.oidc_client_secret or None,
        server_metadata_url=f"{settings.oidc_issuer.rstrip('/')}/.well-known/openid-configuration",
        client_kwargs={"scope": scopes(settings), "code_challenge_method": "S256", "timeout": 10},
    )
    return oauth


def scopes(settings: Settings) -> str:
    """``DEDLOC_OIDC_SCOPES``, or by provider: Hugging Face lists a user's organizations (teams, org-only runs)
    only to apps that ask for ``read-org``; other providers get the plain OpenID Connect scopes."""
    if settings.oidc_scopes.strip():
        return settings.oidc_scopes.strip()
    return "openid profile read-org" if provider_name(settings) == "Hugging Face" else "openid profile"


def provider_name(settings: Settings) -> str:
    host = urlsplit(settings.oidc_issuer).hostname or settings.oidc_issuer
    return "Hugging Face" if host == "huggingface.co" else host


async def redirect_to_provider(oauth: OAuth, request: Request, redirect_uri: str) -> Response:
    """A redirect to the provider's authorization endpoint; state, nonce and PKCE verifier go in the session."""
    try:
        return await oauth.create_client(NAME).authorize_redirect(request, redirect_uri)
    except PROVIDER_ERRORS as e:
        raise SignInRefused(f"cannot use the sign-in provider's discovery document ({e}); try again later, or "
                            "tell this portal's operator", 502) from None


async def identity_from_callback(oauth: OAuth, request: Request, settings: Settings) -> Identity:
    """Check the provider's answer on the redirect back and return who signed in."""
    client = oauth.create_client(NAME)
    try:
        metadata = await client.load_server_metadata()
        _check_issuer(metadata, settings)
        token = await client.authorize_access_token(request, claims_options=_claims_options(metadata, settings),
                                                    leeway=LEEWAY)
        claims = token.get("userinfo")
        if not claims:
            raise SignInRefused("the provider sent no ID token; DEDLOC_OIDC_SCOPES must include `openid`")
        info = claims
        # Hugging Face puts `orgs` in userinfo, not in the ID token; a provider may leave out the username too.
        wants_orgs = "read-org" in scopes(settings).split() and "orgs" not in claims
        if not claims.get("preferred_username") or wants_orgs:
            info = await _checked_userinfo(client, token, claims)
        username = claims.get("preferred_username") or info.get("preferred_username")
        if not username:
            raise SignInRefused("the provider did not tell a username (`preferred_username`); DEDLOC_OIDC_SCOPES "
                                "should include `profile`")
    except MismatchingStateError:
        raise SignInRefused("this sign-in was not started in this browser, or was already finished (the state "
                            "does not match); start again from the sign-in page") from None
    except OAuthError as e:
        raise _provider_refusal(e) from None
    except JoseError as e:
        raise _id_token_refusal(e) from None
    except PROVIDER_ERRORS as e:
        raise SignInRefused(f"cannot complete the sign-in with the provider ({e}); try again later", 502) from None
    return Identity(issuer=claims["iss"], subject=claims["sub"], username=username,
                    organizations=organizations_of(claims if "orgs" in claims else info))


def organizations_of(claims: dict) -> tuple:
    """Organization names from an `orgs` claim: a list of names or of objects with `preferred_username`."""
    names = []
    for org in claims.get("orgs") or []:
        name = org.get("preferred_username") or org.get("name") if isinstance(org, dict) else org
        if isinstance(name, str) and name:
            names.append(name)
    return tuple(names)


def _check_issuer(metadata: dict, settings: Settings) -> None:
    # OpenID Connect Discovery 1.0, 4.3: the document must name the issuer it was fetched for.
    if str(metadata.get("issuer", "")).rstrip("/") != settings.oidc_issuer.rstrip("/"):
        raise SignInRefused(f"the provider's discovery document names issuer {metadata.get('issuer')!r}, not "
                            f"the configured {settings.oidc_issuer!r}; fix DEDLOC_OIDC_ISSUER", 502)


def _claims_options(metadata: dict, settings: Settings) -> dict:
    return {
        "iss": {"essential": True, "value": metadata["issuer"]},
        "aud": {"essential": True, "value": settings.oidc_client_id},
        "exp": {"essential": True},
        "sub": {"essential": True},
    }


async def _checked_userinfo(client, token: dict, claims: dict) -> dict:
    info = await client.userinfo(token=token)
    if info.get("sub") != claims["sub"]:
        raise SignInRefused("the provider's userinfo names another subject than its ID token", 502)
    return dict(info)


def _provider_refusal(e: OAuthError) -> SignInRefused:
    said = f"{e.error}: {e.description}" if e.description else e.error
    if e.error == "access_denied":
        return SignInRefused(f"the provider did not let you sign in ({said}); try again if that was a mistake",
                             403)
    return SignInRefused(f"the provider refused the sign-in ({said}); start again from the sign-in page")


def _id_token_refusal(e: JoseError) -> SignInRefused:
    if isinstance(e, ExpiredTokenError):
        reason = "it has expired (check that this server's clock is right)"
    elif isinstance(e, ClaimError) and e.claim == "nonce":
        reason = "its nonce is not the one this sign-in sent (a replayed or mixed-up token)"
    elif isinstance(e, ClaimError) and e.claim in ("aud", "azp"):
        reason = "it was issued for another application (audience), not this portal's client id"
    elif isinstance(e, ClaimError) and e.claim == "iss":
        reason = "it was issued by another provider (issuer)"
    elif isinstance(e, ClaimError):
        reason = f"its claim {e.claim!r} is missing or wrong"
    elif isinstance(e, BadSignatureError):
        reason = "its signature does not verify with the provider's published keys"
    else:
        reason = str(e)
    return SignInRefused(f"the provider's ID token was refused: {reason}; start again from the sign-in page", 401)
