"""A run's checkpoints as the portal keeps them: archives under DATA_DIR/runs/<slug>/checkpoints, one row each.

The checkpointer (app/coordinator/checkpointer.py, in the coordinator's process) writes them; the portal lists and
serves them; pruning keeps the newest ``keep`` and every final one."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from dedloc_common.contract import API_PREFIX, CheckpointInfo
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.clock import as_utc
from app.core.errors import NotFound
from app.models import Checkpoint, Run
from app.runs import evaluations


def checkpoints_dir(data_dir: Path | str, slug: str) -> Path:
    return Path(data_dir).resolve() / "runs" / slug / "checkpoints"


def newest_first(session: Session, run: Run) -> list[Checkpoint]:
    query = select(Checkpoint).where(Checkpoint.run_id == run.id).order_by(Checkpoint.epoch.desc())
    return list(session.scalars(query))


def latest(session: Session, run: Run) -> Optional[Checkpoint]:
    rows = newest_first(session, run)
    return rows[0] if rows else None


def describe(row: Checkpoint, slug: str, base_url: str = "") -> CheckpointInfo:
    return CheckpointInfo(epoch=row.epoch, samples=row.samples, created_at=as_utc(row.created_at),
                          eval_loss=row.eval_loss, sha256=row.sha256, size=row.size, final=row.final,
                          url=f"{base_url}{API_PREFIX}/runs/{slug}/checkpoints/{row.epoch}.tar")


def archive_of(session: Session, data_dir: Path | str, run: Run, epoch: int) -> Path:
    row = session.scalar(select(Checkpoint).where(Checkpoint.run_id == run.id, Checkpoint.epoch == epoch))
    path = checkpoints_dir(data_dir, run.slug) / row.file_name if row is not None else None
    if path is None or not path.exists():
        raise NotFound(f"run {run.slug!r} has no checkpoint at epoch {epoch}")
    return path


def record(session: Session, run: Run, *, epoch: int, samples: int, eval_loss: Optional[float], sha256: str,
           size: int, file_name: str, final: bool = False) -> Checkpoint:
    """Add (or replace, for the same epoch) a checkpoint row; the caller commits."""
    row = session.scalar(select(Checkpoint).where(Checkpoint.run_id == run.id, Checkpoint.epoch == epoch))
    if row is None:
        row = Checkpoint(run_id=run.id, epoch=epoch)
        session.add(row)
    row.samples, row.eval_loss, row.sha256, row.size, row.file_name = samples, eval_loss, sha256, size, file_name
    row.final = row.final or final
    session.flush()
    return row


def prune(session: Session, data_dir: Path | str, run: Run, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` checkpoints (final ones stay); the epochs deleted."""
    gone = []
    for row in [r for r in newest_first(session, run) if not r.final][keep:]:
        (checkpoints_dir(data_dir, run.slug) / row.file_name).unlink(missing_ok=True)
        gone.append(row.epoch)
        session.delete(row)
    return gone


def store_archive(session: Session, data_dir: Path | str, run: Run, *, epoch: int, samples: int,
                  eval_loss: Optional[float], sha256: str, size: int, file_name: str, final: bool,
                  keep: int) -> list[int]:
    """What the checkpointer does with an archive it wrote: its row, its evaluation (kept whatever pruning does
    later), and pruning to the newest ``keep``; the epochs pruned. The caller commits."""
    record(session, run, epoch=epoch, samples=samples, eval_loss=eval_loss, sha256=sha256, size=size,
           file_name=file_name, final=final)
    if eval_loss is not None:
        evaluations.record_evaluation(session, run, epoch=epoch, samples=samples, eval_loss=eval_loss)
    return prune(session, data_dir, run, keep)
