"""What a run needs in memory on a volunteer's device, as its workers measured it before joining (each metrics record
carries ``contract.MemoryReport``; the coordinator keeps the newest per peer): the join page shows the newest report
per kind of device and precision."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from dedloc_common.contract import MemoryReport
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.clock import as_utc
from app.models import Peer, Run

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class MeasuredNeed:
    """One kind of device's figures, in words for the join page."""

    device: str  # "a GPU (bfloat16)", "a CPU (float32)"
    model: str  # "1.20 GiB": parameters, gradients, optimizer state
    per_sample: str  # "35.0 MiB"
    peak: str  # "1.48 GiB at 8 samples per micro-batch"
    host: str  # "" or "2.40 GiB of RAM for the offloaded optimizer"
    measured_at: datetime


def measured_needs(session: Session, run: Run) -> list[MeasuredNeed]:
    """The newest report of each (device, precision) among the run's peers, GPUs first."""
    rows = session.scalars(select(Peer).where(Peer.run_id == run.id, Peer.memory.is_not(None))
                           .order_by(Peer.last_seen.desc(), Peer.id.desc()))
    newest: dict[tuple[str, str], tuple[MemoryReport, datetime]] = {}
    for peer in rows:
        try:
            report = MemoryReport.parse_obj(peer.memory)
        except ValueError:  # a row from a worker whose report this portal cannot read: shown as nothing
            continue
        newest.setdefault((report.device, report.precision), (report, as_utc(peer.last_seen)))
    return [describe(report, seen) for (device, _), (report, seen)
            in sorted(newest.items(), key=lambda item: (item[0][0] != "cuda", item[0]))]


def describe(report: MemoryReport, seen: datetime) -> MeasuredNeed:
    kind = "a GPU" if report.device == "cuda" else "a CPU" if report.device == "cpu" else report.device
    samples = f"{report.micro_batch} sample{'s' if report.micro_batch != 1 else ''}"
    return MeasuredNeed(
        device=f"{kind} ({report.precision})", model=f"{report.model_bytes / GIB:.2f} GiB",
        per_sample=f"{report.per_sample_bytes / MIB:.1f} MiB", peak=f"{report.peak_bytes / GIB:.2f} GiB at {samples}",
        host=f"{report.host_bytes / GIB:.2f} GiB of RAM" if report.host_bytes else "", measured_at=seen)
