"""Users and their API credentials: sign-in bookkeeping, issuing, checking and revoking bearer credentials."""

from __future__ import annotations

import hashlib
import re
import secrets
from datetime import timedelta
from typing import Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.clock import as_utc, utcnow
from app.core.config import Settings
from app.identity.errors import SignInRefused, Unauthorized
from app.identity.models import ApiCredential, User

USERNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
CREDENTIAL_PREFIX = "dedloc_"
# last_used_at is a hint for people, not an audit log: writing it at most once a minute spares the database.
LAST_USED_PRECISION = timedelta(seconds=60)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def check_username(username: str) -> str:
    if not USERNAME.match(username):
        raise SignInRefused(f"{username!r} is not a usable username: use letters, digits, '-', '_' or '.', "
                            "starting with a letter or digit, at most 100 characters")
    return username


def is_organizer(settings: Settings, user: Optional[User]) -> bool:
    return user is not None and user.username in settings.organizers


def get_user(session: Session, user_id: int) -> Optional[User]:
    return session.get(User, user_id)


def sign_in_locally(session: Session, *, username: str) -> User:
    """The development sign-in: the user named ``username``, created on first use."""
    user = session.scalar(select(User).where(User.username == check_username(username)))
    if user is not None and user.oidc_subject is not None:
        raise SignInRefused(f"{username!r} belongs to an account of {user.oidc_issuer}; sign in there", 403)
    if user is None:
        user = User(username=username)
        session.add(user)
        session.commit()
    return user


def sign_in_with_provider(session: Session, *, issuer: str, subject: str, username: str,
                          organizations: tuple = ()) -> User:
    """The user the provider knows as (issuer, subject), created on first sign-in under ``username``; the
    organizations the provider lists are refreshed at every sign-in."""
    user = session.scalar(select(User).where(User.oidc_issuer == issuer, User.oidc_subject == subject))
    if user is not None:
        user.organizations = list(organizations)
        session.commit()
        return user
    if session.scalar(select(User.id).where(User.username == check_username(username))) is not None:
        raise SignInRefused(f"the username {username!r} is already taken by another account on this portal; "
                            "ask its operator to rename one of them", 409)
    user = User(username=username, oidc_issuer=issuer, oidc_subject=subject, organizations=list(organizations))
    session.add(user)
    session.commit()
    return user


def issue_credential(session: Session, *, user_id: int, client_name: Optional[str] = None) -> str:
    """A new random bearer credential for the user; only its hash is kept, so it is shown once. Not committed."""
    secret = CREDENTIAL_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiCredential(user_id=user_id, token_hash=hash_secret(secret), client_name=client_name))
    return secret


def issue_headless_credential(session: Session, username: str) -> str:
    """``dedloc issue-credential``: a worker credential for ``username`` (signed up on first use), for a machine
    that cannot open a browser; committed."""
    user = sign_in_locally(session, username=username)
    secret = issue_credential(session, user_id=user.id, client_name="dedloc issue-credential")
    session.commit()
    return secret


def authenticate(session: Session, secret: str, lifetime: float = 0.0) -> User:
    """The user holding ``secret``; ``Unauthorized`` when it is unknown, revoked, or older than ``lifetime``
    seconds (0: no limit)."""
    found = session.execute(
        select(ApiCredential, User).join(User).where(ApiCredential.token_hash == hash_secret(secret))
    ).one_or_none()
    if found is None:
        raise Unauthorized("unknown API credential; log in again with `dedloc-worker login <portal-url>`")
    credential, user = found
    if credential.revoked_at is not None:
        raise Unauthorized("this API credential was revoked; log in again with `dedloc-worker login <portal-url>`")
    now = utcnow()
    if lifetime and now - as_utc(credential.created_at) > timedelta(seconds=lifetime):
        raise Unauthorized("this API credential expired (this portal's credentials last "
                           f"{lifetime / 86400:g} days); log in again with `dedloc-worker login <portal-url>`")
    if credential.last_used_at is None or now - as_utc(credential.last_used_at) > LAST_USED_PRECISION:
        credential.last_used_at = now
        session.commit()
    return user


def machine_credentials(session: Session, user_id: int) -> list[ApiCredential]:
    """The user's API credentials, newest first, revoked ones included (they say when)."""
    return list(session.scalars(select(ApiCredential).where(ApiCredential.user_id == user_id)
                                .order_by(ApiCredential.created_at.desc(), ApiCredential.id.desc())))


def revoke_machine_credential(session: Session, user_id: int, credential_id: int) -> bool:
    """Revoke the user's credential ``credential_id``; False when it is not theirs or was revoked already."""
    credential = session.get(ApiCredential, credential_id)
    if credential is None or credential.user_id != user_id or credential.revoked_at is not None:
        return False
    credential.revoked_at = utcnow()
    session.commit()
    return True


def revoke_credential(session: Session, secret: str) -> bool:
    """Revoke the credential ``secret``; False when it was unknown or already revoked."""
    credential = session.scalar(select(ApiCredential).where(ApiCredential.token_hash == hash_secret(secret)))
    if credential is None or credential.revoked_at is not None:
        return False
    credential.revoked_at = utcnow()
    session.commit()
    return True
