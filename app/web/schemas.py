"""Response schemas of the public JSON API (a contract: fields may be added, never renamed).

Where a domain module's own model has the answer's shape, the API returns that model instead (plans.PublicPlan,
ledger.LeaderboardEntry, standings.TeamEntry and UserTotals); the same contract holds for them.
"""

from __future__ import annotations

import re
from typing import Annotated, Optional

from dedloc_common.contract import UtcDateTime
from pydantic import BaseModel, BeforeValidator

RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def rfc3339_text(value: object) -> object:
    """Only RFC 3339 date-times with their offset, as the document says (pydantic alone also takes Unix times and
    dates). In a URL, an offset's ``+`` must be written ``%2B``."""
    if isinstance(value, str) and not RFC3339.fullmatch(value):
        raise ValueError("an RFC 3339 date-time with its offset, e.g. 2026-01-01T00:00:00Z")
    return value


# A moment a client sends (a query value): RFC 3339 with offset, handled in UTC.
UtcDateTimeIn = Annotated[UtcDateTime, BeforeValidator(rfc3339_text)]


class RunOut(BaseModel):
    slug: str
    title: str
    task: str
    target_batch_size: int
    batch_size: int
    created_at: UtcDateTime


class SwarmOut(BaseModel):
    peers_online: int
    samples_per_second: float
    epoch: int
    loss: Optional[float]
    samples_total: int
    samples_accumulated: int
    eta_seconds: Optional[float]
    target_batch_size: int
    updated_at: Optional[UtcDateTime]


class ProbeReceipt(BaseModel):
    """How many bytes of a link probe upload the portal read."""

    bytes: int
