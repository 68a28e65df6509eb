"""A run's evaluations: the held-out loss the checkpointer measured at each checkpoint epoch, as a series of its
own, so that pruning old archives (app/runs/checkpoints.py) never shortens the evaluation chart."""

from __future__ import annotations

from dedloc_common.contract import UtcDateTime
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.clock import as_utc, utcnow
from app.models import Evaluation, Run


class EvaluationOut(BaseModel):
    """One evaluation (``GET /api/v1/runs/{slug}/evaluations``, oldest first)."""

    model_config = ConfigDict(frozen=True)

    epoch: int = Field(ge=0)
    samples: int = Field(ge=0, description="samples the collaboration had averaged when the state was taken")
    eval_loss: float = Field(description="loss on the run's held-out data")
    evaluated_at: UtcDateTime


def record_evaluation(session: Session, run: Run, *, epoch: int, samples: int, eval_loss: float) -> Evaluation:
    """Add (or replace, for the same epoch) one evaluation; the caller commits."""
    row = session.scalar(select(Evaluation).where(Evaluation.run_id == run.id, Evaluation.epoch == epoch))
    if row is None:
        row = Evaluation(run_id=run.id, epoch=epoch)
        session.add(row)
    row.samples, row.eval_loss, row.evaluated_at = samples, eval_loss, utcnow()
    session.flush()
    return row


def series(session: Session, run: Run) -> list[EvaluationOut]:
    """Every evaluation of ``run``, oldest epoch first."""
    rows = session.scalars(select(Evaluation).where(Evaluation.run_id == run.id).order_by(Evaluation.epoch))
    return [EvaluationOut(epoch=row.epoch, samples=row.samples, eval_loss=row.eval_loss,
                          evaluated_at=as_utc(row.evaluated_at)) for row in rows]
