"""Tables of identity: users, their API credentials, and pending device logins."""

from __future__ import annotations

from datetime import datetime
from typing import Optional

from sqlalchemy import JSON, Boolean, CheckConstraint, DateTime, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.core.clock import utcnow
from app.models import Base

DEVICE_STATUSES = ("pending", "approved", "denied", "used")


class User(Base):
    """A person: signed in through an OpenID Connect provider (issuer + subject) or the development sign-in."""

    __tablename__ = "users"
    __table_args__ = (UniqueConstraint("oidc_issuer", "oidc_subject"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    username: Mapped[str] = mapped_column(String(100), unique=True)
    oidc_subject: Mapped[Optional[str]] = mapped_column(String(255), nullable=True)
    oidc_issuer: Mapped[Optional[str]] = mapped_column(String(255), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Public boards and dumps leave hidden users out; they still see their own page.
    hidden: Mapped[bool] = mapped_column(Boolean, default=False)
    # The Hugging Face organization this user chooses to represent on team boards (one of `organizations`).
    team: Mapped[Optional[str]] = mapped_column(String(100), nullable=True)
    # Organizations the identity provider said this user belongs to, at the last sign-in.
    organizations: Mapped[list[str]] = mapped_column(JSON, default=list)


class ApiCredential(Base):
    """A worker's bearer credential. Only its SHA-256 is stored: a database leak does not leak credentials."""

    __tablename__ = "api_credentials"

    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    client_name: Mapped[Optional[str]] = mapped_column(String(200), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_used_at: Mapped[Optional[datetime]] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[Optional[datetime]] = mapped_column(DateTime(timezone=True), nullable=True)


class DeviceCode(Base):
    """One device authorization request (RFC 8628): the worker polls with the device code, the user approves
    the user code in the browser."""

    __tablename__ = "device_codes"
    __table_args__ = (CheckConstraint("status IN ('pending', 'approved', 'denied', 'used')", name="status"),
                      Index("ix_device_codes_requested_from_created_at", "requested_from", "created_at"))

    id: Mapped[int] = mapped_column(primary_key=True)
    device_code_hash: Mapped[str] = mapped_column(String(64), unique=True)
    user_code: Mapped[str] = mapped_column(String(16), unique=True)
    # What the worker says it is ("dedloc-worker 0.1.0 on host"), shown to the approving user.
    client_name: Mapped[Optional[str]] = mapped_column(String(200), nullable=True)
    # The requesting client's address (behind a proxy: what it forwarded), for the per-address rate limit.
    requested_from: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # Seconds the worker must wait between two polls; raised by 5 on each slow_down (RFC 8628, 3.5).
    interval: Mapped[int] = mapped_column(Integer)
    last_polled_at: Mapped[Optional[datetime]] = mapped_column(DateTime(timezone=True), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    user_id: Mapped[Optional[int]] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), nullable=True)
