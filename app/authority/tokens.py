"""Peer tokens: each run's authority key, admission policy, per-account limits, bans and the signed denylist."""

from __future__ import annotations

import base64
import functools
import time
from datetime import datetime, timedelta
from typing import Sequence

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from dedloc_common.contract import PeerToken, PeerTokenGrant, ack_payload, denylist_payload, peer_key_of, token_payload
from dedloc_common.signing import load_public_openssh, new_private_key, peer_id_of, public_openssh, sign
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.clock import as_utc, utcnow
from app.core.config import Settings
from app.core.errors import Forbidden, Invalid, TooManyRequests
from app.core.secrets import secret_key
from app.models import IssuedPeerToken, Run, RunAllowlistEntry, RunBan
from app.runs import registry

ADMISSION_POLICIES = ("open", "allowlist", "org")


def _fernet(settings: Settings) -> Fernet:
    derived = HKDF(hashes.SHA256(), length=32, salt=None, info=b"dedloc run authority keys").derive(
        secret_key(settings).encode()
    )
    return Fernet(base64.urlsafe_b64encode(derived))


def authority_key(session: Session, settings: Settings, run: Run):
    """The run's authority private key, created (and stored encrypted) on first use."""
    if run.authority_key_encrypted is None:
        key = new_private_key()
        der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        run.authority_key_encrypted = _fernet(settings).encrypt(der)
        session.commit()
        return key
    try:
        der = _fernet(settings).decrypt(run.authority_key_encrypted)
    except InvalidToken:
        raise Invalid("the run's authority key cannot be decrypted: DEDLOC_SECRET_KEY changed") from None
    return _loaded_key(der)


@functools.lru_cache(maxsize=64)
def _loaded_key(der: bytes):
    # Parsing checks the RSA key: 34 ms of CPU here, against 0.4 ms for a signature. The coordinator signs at every
    # poll and the portal at every token and denylist request, so each key is parsed once per process.
    return serialization.load_der_private_key(der, password=None)


def authority_public_key(session: Session, settings: Settings, run: Run) -> str:
    return public_openssh(authority_key(session, settings, run)).decode()


def is_banned(session: Session, run: Run, username: str) -> bool:
    return session.scalar(select(RunBan.id).where(RunBan.run_id == run.id, RunBan.username == username)) is not None


def check_admission(session: Session, run: Run, username: str, organizations: Sequence[str] = ()) -> None:
    """``Forbidden`` with the reason in words when ``run`` does not admit ``username``."""
    if is_banned(session, run, username):
        raise Forbidden(f"{username} is banned from run {run.slug!r} by its organizers")
    if run.admission == "allowlist":
        listed = session.scalar(select(RunAllowlistEntry.id).where(
            RunAllowlistEntry.run_id == run.id, RunAllowlistEntry.username == username))
        if listed is None:
            raise Forbidden(f"run {run.slug!r} admits only allowlisted volunteers; ask its organizers to add "
                            f"{username}")
    elif run.admission == "org" and run.admission_org not in organizations:
        raise Forbidden(f"run {run.slug!r} admits only members of the {run.admission_org} organization")


def check_limits(session: Session, settings: Settings, run: Run, username: str, peer_id: str) -> None:
    """``TooManyRequests`` past the token rate or the concurrent-peer limit of one account."""
    now = utcnow()
    recent = session.scalars(select(IssuedPeerToken.issued_at).where(
        IssuedPeerToken.username == username, IssuedPeerToken.issued_at > now - timedelta(minutes=1)
    ).order_by(IssuedPeerToken.issued_at)).all()
    if len(recent) >= settings.peer_token_requests_per_minute:
        retry = 60 - (now - as_utc(recent[0])).total_seconds()
        raise TooManyRequests(f"more than {settings.peer_token_requests_per_minute} token requests in a minute; "
                              f"retry in {retry:.0f} s", retry_after=max(retry, 1))
    live_peers = session.scalars(select(IssuedPeerToken.peer_id).where(
        IssuedPeerToken.run_id == run.id, IssuedPeerToken.username == username, IssuedPeerToken.expires_at > now
    ).distinct()).all()
    if peer_id not in live_peers and len(live_peers) >= settings.max_concurrent_peers:
        raise TooManyRequests(f"{username} already runs {len(live_peers)} peers in this run, the most allowed; "
                              "stop one, or retry once its token expires", retry_after=settings.peer_token_lifetime)


def issue_peer_token(
    session: Session, settings: Settings, run: Run, username: str, public_key: str, organizations: Sequence[str] = (),
    service: bool = False,
) -> PeerTokenGrant:
    """Sign a token binding ``username`` to ``public_key`` for the configured lifetime, and record it."""
    try:
        peer_id = peer_id_of(public_key)
        key_bytes = public_openssh_normalized(public_key)
    except ValueError as e:
        raise Invalid(f"public_key must be an RSA key of at least 2048 bits in OpenSSH format ({e})") from None
    if not service:
        check_admission(session, run, username, organizations)
        check_limits(session, settings, run, username, peer_id)
    authority = authority_key(session, settings, run)
    expires = utcnow() + timedelta(seconds=settings.peer_token_lifetime)
    expiration_time = expires.replace(tzinfo=None).isoformat(timespec="seconds")
    signature = sign(authority, token_payload(username, key_bytes, expiration_time))
    session.add(IssuedPeerToken(run_id=run.id, username=username, peer_public_key=key_bytes.decode(),
                                peer_id=peer_id, peer_key=peer_key_of(key_bytes), expires_at=expires))
    session.commit()
    return PeerTokenGrant(
        token=PeerToken(username=username, public_key=key_bytes.decode(), expiration_time=expiration_time,
                        signature=signature),
        authority_public_key=public_openssh(authority).decode(),
        lifetime_seconds=settings.peer_token_lifetime,
        join=registry.join_info(session, run, settings.coordinator_timeout),
    )


def issue_service_token(session: Session, settings: Settings, run: Run, public_key: bytes, name: str) -> PeerToken:
    """A token for the deployment's own peers (the coordinator): no admission policy, no limits, recorded."""
    return issue_peer_token(session, settings, run, name, public_key.decode(), service=True).token


def public_openssh_normalized(public_key: str) -> bytes:
    """The key re-encoded (drops comments and whitespace), so the token carries exactly what hivemind sends."""
    return load_public_openssh(public_key.strip()).public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )


def ban_user(session: Session, run: Run, username: str, banned_by: str, reason: str = "") -> None:
    if not is_banned(session, run, username):
        session.add(RunBan(run_id=run.id, username=username, banned_by=banned_by, reason=reason))
        session.commit()


def unban_user(session: Session, run: Run, username: str) -> None:
    ban = session.scalar(select(RunBan).where(RunBan.run_id == run.id, RunBan.username == username))
    if ban is not None:
        session.delete(ban)
        session.commit()


def set_admission(session: Session, run: Run, policy: str, org: str | None = None) -> None:
    """Change who may get tokens; ``Invalid`` for an unknown policy or an "org" policy without an org."""
    if policy not in ADMISSION_POLICIES:
        raise Invalid(f"admission must be one of {', '.join(ADMISSION_POLICIES)}")
    if policy == "org" and not (org or "").strip():
        raise Invalid("name the Hugging Face organization whose members this run admits")
    run.admission, run.admission_org = policy, (org or "").strip() or None
    session.commit()


def allowlist(session: Session, run: Run) -> list[str]:
    return sorted(session.scalars(select(RunAllowlistEntry.username).where(RunAllowlistEntry.run_id == run.id)))


def allow_user(session: Session, run: Run, username: str) -> None:
    if username not in allowlist(session, run):
        session.add(RunAllowlistEntry(run_id=run.id, username=username))
        session.commit()


def disallow_user(session: Session, run: Run, username: str) -> None:
    entry = session.scalar(select(RunAllowlistEntry).where(
        RunAllowlistEntry.run_id == run.id, RunAllowlistEntry.username == username))
    if entry is not None:
        session.delete(entry)
        session.commit()


def bans(session: Session, run: Run) -> list[RunBan]:
    return list(session.scalars(select(RunBan).where(RunBan.run_id == run.id).order_by(RunBan.created_at)))


def banned_usernames(session: Session, run: Run) -> list[str]:
    return sorted(session.scalars(select(RunBan.username).where(RunBan.run_id == run.id)))


def signed_denylist(session: Session, settings: Settings, run: Run) -> dict:
    """The run's bans as the coordinator publishes them: signed by the authority, so peers can trust it."""
    usernames, issued_at = banned_usernames(session, run), time.time()
    signature = sign(authority_key(session, settings, run), denylist_payload(usernames, issued_at))
    return {"usernames": usernames, "issued_at": issued_at, "signature": signature}


def sign_plan(session: Session, settings: Settings, run: Run, payload: bytes) -> str:
    """The authority's signature over an averaging plan (``contract.plan_payload``), so workers can trust it."""
    return sign(authority_key(session, settings, run), payload)


def signed_acks(session: Session, settings: Settings, run: Run, epochs: dict[str, int]) -> list[dict]:
    """The coordinator's acknowledgements (``contract.AckRecord`` fields): every claim of each peer key up to its
    epoch is in the database. Signed by the authority, so a worker drops a claim only on the run's word."""
    if not epochs:
        return []
    key, issued_at = authority_key(session, settings, run), time.time()
    return [{"peer_key": peer_key, "epoch": epoch, "issued_at": issued_at,
             "signature": sign(key, ack_payload(peer_key, epoch, issued_at))} for peer_key, epoch in epochs.items()]


def token_holders(session: Session, run: Run) -> list[tuple[str, int, datetime]]:
    """(username, peers, latest expiry) of everyone holding an unexpired token: what organizers see."""
    query = (
        select(IssuedPeerToken.username, func.count(func.distinct(IssuedPeerToken.peer_id)),
               func.max(IssuedPeerToken.expires_at))
        .where(IssuedPeerToken.run_id == run.id, IssuedPeerToken.expires_at > utcnow())
        .group_by(IssuedPeerToken.username).order_by(IssuedPeerToken.username)
    )
    return [(username, int(peers), as_utc(expiry)) for username, peers, expiry in session.execute(query)]

