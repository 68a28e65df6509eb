"""The device authorization grant (RFC 8628): a worker asks for a code, its user approves it in the browser,
the worker polls until it receives an API credential."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Optional, cast

from sqlalchemy import CursorResult, delete, select, update
from sqlalchemy.orm import Session

from app.core.clock import as_utc, utcnow
from app.core.errors import TooManyRequests
from app.identity.accounts import hash_secret, issue_credential
from app.identity.errors import DeviceGrantError, UserCodeRefused
from app.identity.models import DeviceCode, User

# Consonants only (RFC 8628, 6.1): no vowels means no words, and no 0/O or 1/I to misread.
ALPHABET = "BCDFGHJKLMNPQRSTVWXZ"
USER_CODE_LENGTH = 8
# A poll this much earlier than the interval is "too fast": leaves room for network jitter.
POLL_TOLERANCE = 0.8
# Expired device codes are kept this long, so a late poll still hears expired_token rather than invalid_grant.
KEEP_EXPIRED = timedelta(hours=1)


@dataclass(frozen=True)
class DevicePolicy:
    """:param lifetime: seconds a device code stays valid. :param interval: seconds between two polls."""

    lifetime: float = 600.0
    interval: int = 5
    # Device logins one client address may start per minute: each is a row and a code to guess against.
    per_address_per_minute: int = 20


@dataclass(frozen=True)
class DeviceAuthorization:
    device_code: str
    user_code: str
    expires_in: int
    interval: int


@dataclass(frozen=True)
class DeviceGrant:
    access_token: str
    username: str


def new_user_code() -> str:
    letters = "".join(secrets.choice(ALPHABET) for _ in range(USER_CODE_LENGTH))
    return f"{letters[:4]}-{letters[4:]}"


def normalize_user_code(text: str) -> Optional[str]:
    """The canonical XXXX-XXXX form of what a person typed (any case, dashes or spaces), or None."""
    letters = re.sub(r"[\s-]", "", text).upper()
    if len(letters) != USER_CODE_LENGTH or any(c not in ALPHABET for c in letters):
        return None
    return f"{letters[:4]}-{letters[4:]}"


def start_device_login(session: Session, *, policy: DevicePolicy, client_name: Optional[str] = None,
                       requested_from: Optional[str] = None) -> DeviceAuthorization:
    """A new device login; ``TooManyRequests`` past the policy's per-address rate (counted in the database, so
    every web process shares it)."""
    now = utcnow()
    session.execute(delete(DeviceCode).where(DeviceCode.expires_at < now - KEEP_EXPIRED))
    if requested_from is not None:
        recent = session.scalars(select(DeviceCode.created_at).where(
            DeviceCode.requested_from == requested_from, DeviceCode.created_at > now - timedelta(minutes=1)
        ).order_by(DeviceCode.created_at)).all()
        if len(recent) >= policy.per_address_per_minute:
            session.commit()  # the clean-up above stands
            retry = 60 - (now - as_utc(recent[0])).total_seconds()
            raise TooManyRequests(f"more than {policy.per_address_per_minute} device logins a minute from this "
                                  f"address; retry in {retry:.0f} s", retry_after=max(retry, 1))
    device_code = secrets.token_urlsafe(32)
    user_code = new_user_code()
    while session.scalar(select(DeviceCode.id).where(DeviceCode.user_code == user_code)) is not None:
        user_code = new_user_code()
    session.add(DeviceCode(
        device_code_hash=hash_secret(device_code), user_code=user_code, client_name=client_name,
        requested_from=requested_from, created_at=now,
        expires_at=now + timedelta(seconds=policy.lifetime), interval=policy.interval, status="pending",
    ))
    session.commit()
    return DeviceAuthorization(device_code, user_code, int(policy.lifetime), policy.interval)


def pending_device_code(session: Session, user_code: str) -> DeviceCode:
    """The device login waiting for a decision under ``user_code``; ``UserCodeRefused`` with the reason."""
    canonical = normalize_user_code(user_code)
    row = None
    if canonical is not None:
        row = session.scalar(select(DeviceCode).where(DeviceCode.user_code == canonical))
    if row is None:
        raise UserCodeRefused(f"no device login has the code {user_code!r}; check the code your terminal shows",
                              404)
    if row.status != "pending":
        raise UserCodeRefused(f"the code {canonical} was already {row.status}; run `dedloc-worker login` again")
    if as_utc(row.expires_at) <= utcnow():
        raise UserCodeRefused(f"the code {canonical} has expired; run `dedloc-worker login` again")
    return row


def decide_device_login(session: Session, *, user_code: str, user: User, approve: bool) -> DeviceCode:
    """Approve (for ``user``) or deny a pending device login; ``UserCodeRefused`` when it is not pending."""
    row = pending_device_code(session, user_code)
    # An UPDATE answers a CursorResult; Session.execute is typed with the Result of any statement.
    decided = cast(CursorResult[Any], session.execute(
        update(DeviceCode).where(DeviceCode.id == row.id, DeviceCode.status == "pending")
        .values(status="approved" if approve else "denied", user_id=user.id)
    ))
    if decided.rowcount != 1:  # decided by another request in between
        session.rollback()
        raise UserCodeRefused(f"the code {row.user_code} was decided meanwhile; run `dedloc-worker login` again")
    session.commit()
    session.refresh(row)
    return row


def poll_device_login(session: Session, *, device_code: str) -> DeviceGrant:
    """The worker's poll: a new credential once approved (exactly once), ``DeviceGrantError`` otherwise."""
    row = session.scalar(select(DeviceCode).where(DeviceCode.device_code_hash == hash_secret(device_code)))
    now = utcnow()
    if row is None:
        raise DeviceGrantError("invalid_grant", "unknown device code; start the login again")
    if row.status == "used":
        raise DeviceGrantError("invalid_grant", "this device code was already used; start the login again")
    if row.status == "denied":
        raise DeviceGrantError("access_denied", "the login was denied in the browser")
    if as_utc(row.expires_at) <= now:
        raise DeviceGrantError("expired_token", "the device code expired before it was approved; "
                                                "start the login again")
    if row.status == "approved":
        return _redeem(session, row)
    return _still_pending(session, row, now)


def _redeem(session: Session, row: DeviceCode) -> DeviceGrant:
    # Only one poll may turn an approval into a credential, however many arrive at once.
    redeemed = cast(CursorResult[Any], session.execute(
        update(DeviceCode).where(DeviceCode.id == row.id, DeviceCode.status == "approved").values(status="used")
    ))
    if redeemed.rowcount != 1:
        session.rollback()
        raise DeviceGrantError("invalid_grant", "this device code was already used; start the login again")
    user = session.get_one(User, row.user_id)  # an approved code names its user
    secret = issue_credential(session, user_id=user.id, client_name=row.client_name)
    session.commit()
    return DeviceGrant(access_token=secret, username=user.username)


def _still_pending(session: Session, row: DeviceCode, now: datetime) -> DeviceGrant:
    too_fast = row.last_polled_at is not None and (
        (now - as_utc(row.last_polled_at)).total_seconds() < POLL_TOLERANCE * row.interval
    )
    row.last_polled_at = now
    if too_fast:
        row.interval += 5  # RFC 8628, 3.5: for this and all later polls
    session.commit()
    if too_fast:
        raise DeviceGrantError("slow_down", f"polling too fast; wait {row.interval} s between polls")
    raise DeviceGrantError("authorization_pending", "waiting for the user to approve the code in the browser")
