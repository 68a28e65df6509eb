"""Response schemas of the public JSON API (a contract: fields may be added, never renamed).

Where a domain module's own model has the answer's shape, the API returns that model instead (plans.PublicPlan,
ledger.LeaderboardEntry, standings.TeamEntry and UserTotals); the same contract holds for them.
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


class ProbeReceipt(BaseModel):
    """How many bytes of a link probe upload the portal read."""

    bytes: int
