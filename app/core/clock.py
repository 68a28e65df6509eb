"""Time: every moment the portal and coordinator store or compare is timezone-aware UTC."""

from __future__ import annotations

from datetime import datetime, timezone


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def as_utc(moment: datetime) -> datetime:
    """SQLite hands back naive datetimes for timezone-aware columns; everything is written in UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
