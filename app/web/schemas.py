"""Response schemas of the public JSON API (a contract: fields may be added, never renamed).

Where a domain module's own model has the answer's shape, the API returns that model instead (plans.PublicPlan);
the same contract holds for it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Optional

from pydantic import BaseModel, field_serializer


class RunOut(BaseModel):
    slug: str
    title: str
    task: str
    target_batch_size: int
    batch_size: int
    created_at: datetime


class SwarmOut(BaseModel):
    peers_online: int
    samples_per_second: float
    epoch: int
    loss: Optional[float]
    samples_total: int
    samples_accumulated: int
    eta_seconds: Optional[float]
    target_batch_size: int
    updated_at: Optional[datetime]

    @field_serializer("updated_at")
    def _utc(self, value: Optional[datetime]) -> Optional[str]:
        if value is None:
            return None
        return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).isoformat()


class LeaderboardEntry(BaseModel):
    """A user on a board: ``samples`` credited, ``held_samples`` held back for review, ``runtime_seconds`` their
    peers spent in counted epochs, ``team`` they represent (or null), ``last_seen`` when an epoch was recorded."""

    username: str
    samples: int
    runtime_seconds: float
    peers: int
    held_samples: int = 0
    team: Optional[str] = None
    last_seen: Optional[datetime] = None


class TotalsOut(BaseModel):
    samples: int
    held_samples: int
    runtime_seconds: float
    peers: int
    last_seen: Optional[datetime]


class TeamEntry(TotalsOut):
    """A team on a board: the sums of its public members (``members`` of them credited or held)."""

    team: str
    members: int


class RunTotalsOut(TotalsOut):
    run: str


class UserOut(TotalsOut):
    """A user's public totals across runs, and per run (oldest run first)."""

    username: str
    team: Optional[str]
    runs: list[RunTotalsOut]


class ProbeReceipt(BaseModel):
    """How many bytes of a link probe upload the portal read."""

    bytes: int
