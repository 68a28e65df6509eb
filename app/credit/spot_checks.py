"""Spot checks, the verdict: a claim's published gradient sketch against the one the checkpointer recomputed on the
peer's own data (``app/coordinator/spot_checker.py``), and what a failure does to the peer's credit.

``judge`` is a pure function of the two sketches and the two mean losses. A failed check is kept with its evidence
(``SpotCheck``) and holds every claim of that peer key in the run, now and later (``settlement.settle`` asks
``failed_checks``); organizers see the evidence on the organize page and may release the credit as any held credit.
docs/spot-checks.md says what a check can and cannot catch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable

from dedloc_common.contract import decode_sketch
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.models import Contribution, Run, SpotCheck

# An honest peer's sketch and the recomputed one differ only by float16 transport and, where the peer was a step
# behind or the served state drifted, by one optimizer step: docs/spot-checks.md gives the cosines measured. A
# sign-flipped gradient scores -1, an unrelated one about 0 (+-1/8 with 64 buckets).
MIN_COSINE = 0.5
NORM_RATIO = 3.0  # published norm / recomputed norm must lie within [1/3, 3]: a scaled gradient fails
LOSS_TOLERANCE = 0.25  # relative difference of the mean losses (plus 0.05 absolute) a step of drift stays within
# ... where the loss moves slowly. Where it moves fast (a model an attacker is driving up), a step of drift moves it
# by about what a step moved the swarm's loss, which ``loss_step`` measures and the loss check allows on top.


@dataclass(frozen=True)
class Verdict:
    passed: bool
    cosine: float
    norm_ratio: float
    evidence: str


def judge(published: str, recomputed: str, claimed_loss: float, recomputed_loss: float,
          loss_drift: float = 0.0) -> Verdict:
    """Compare a claim's sketch (``contract.encode_sketch``) with the recomputed one, and the mean losses, which may
    differ by ``loss_drift`` (``loss_step``) more than the tolerance."""
    try:
        mine, theirs = decode_sketch(recomputed), decode_sketch(published)
    except ValueError as e:
        return Verdict(False, 0.0, 0.0, f"its published gradient sketch cannot be read ({e})")
    if len(mine) != len(theirs) or not all(math.isfinite(v) for v in theirs):
        return Verdict(False, 0.0, 0.0, f"its published gradient sketch has {len(theirs)} numbers, not "
                                        f"{len(mine)} finite ones")
    norm_mine, norm_theirs = math.hypot(*mine), math.hypot(*theirs)
    cosine = sum(a * b for a, b in zip(mine, theirs)) / (norm_mine * norm_theirs) if norm_mine and norm_theirs else 0.0
    ratio = norm_theirs / norm_mine if norm_mine else (1.0 if not norm_theirs else math.inf)
    losses_agree = (math.isfinite(claimed_loss)
                    and abs(claimed_loss - recomputed_loss)
                    <= LOSS_TOLERANCE * abs(recomputed_loss) + 0.05 + loss_drift)
    passed = cosine >= MIN_COSINE and 1 / NORM_RATIO <= ratio <= NORM_RATIO and losses_agree
    evidence = (f"the gradient sketch it published against the one recomputed on its own data: cosine "
                f"{cosine:+.2f} (at least {MIN_COSINE} passes), norm {ratio:.3g}x; mean loss claimed "
                f"{claimed_loss:.3f}, recomputed {recomputed_loss:.3f}"
                + (f" (a step moved the swarm's mean loss by {loss_drift:.3f})" if loss_drift else ""))
    return Verdict(passed, cosine, ratio if math.isfinite(ratio) else 1e9, evidence)


def loss_step(session: Session, run: Run, epoch: int) -> float:
    """How much the last step before ``epoch`` moved the swarm's loss: the median of the peers' mean losses claimed
    at ``epoch - 1`` against that at ``epoch - 2``; 0 where either epoch has no claim. The median, so one peer's
    word moves it only as far as the others let it."""
    rows = session.execute(select(Contribution.epoch, Contribution.loss_sum, Contribution.mini_steps).where(
        Contribution.run_id == run.id, Contribution.epoch.in_([epoch - 2, epoch - 1]), Contribution.mini_steps > 0))
    losses: dict[int, list[float]] = {}
    for at, loss_sum, mini_steps in rows:
        if math.isfinite(loss_sum):
            losses.setdefault(at, []).append(loss_sum / mini_steps)
    if len(losses) < 2:
        return 0.0
    return abs(statistics.median(losses[epoch - 1]) - statistics.median(losses[epoch - 2]))


def held_reason(epoch: int, evidence: str) -> str:
    return f"held: this peer failed a spot check at epoch {epoch}: {evidence}"[:Contribution.__table__.c.reason.type
                                                                                .length]


def record_check(session: Session, run: Run, *, peer_key: str, username: str, epoch: int, mini_steps: int,
                 verdict: Verdict, claimed_loss: float, recomputed_loss: float) -> bool:
    """Keep a check's result (once per peer key and epoch); a failure re-decides the peer's claims, held now.
    Returns False when that claim was checked already."""
    exists = session.scalar(select(SpotCheck.id).where(SpotCheck.run_id == run.id, SpotCheck.peer_key == peer_key,
                                                       SpotCheck.epoch == epoch))
    if exists is not None:
        return False
    session.add(SpotCheck(run_id=run.id, peer_key=peer_key, username=username, epoch=epoch, mini_steps=mini_steps,
                          passed=verdict.passed, cosine=verdict.cosine, norm_ratio=verdict.norm_ratio,
                          claimed_loss=claimed_loss, recomputed_loss=recomputed_loss,
                          evidence=verdict.evidence[:SpotCheck.__table__.c.evidence.type.length]))
    session.flush()
    if not verdict.passed:
        from app.credit.settlement import settle

        rows = session.execute(select(Contribution.group_id, Contribution.epoch).where(
            Contribution.run_id == run.id, Contribution.peer_key == peer_key)).all()
        settle(session, run, {group for group, _ in rows if group},
               ungrouped=[(peer_key, epoch) for group, epoch in rows if not group])
    session.commit()
    return True


def failed_checks(session: Session, run: Run, peer_keys: Iterable[str]) -> dict[str, str]:
    """peer key -> the hold's reason, for those of ``peer_keys`` that failed a spot check in ``run`` (the first)."""
    query = select(SpotCheck.peer_key, SpotCheck.epoch, SpotCheck.evidence).where(
        SpotCheck.run_id == run.id, SpotCheck.passed.is_(False), SpotCheck.peer_key.in_(list(set(peer_keys)))
    ).order_by(SpotCheck.epoch)
    found: dict[str, str] = {}
    for peer_key, epoch, evidence in session.execute(query):
        found.setdefault(peer_key, held_reason(epoch, evidence))
    return found


@dataclass(frozen=True)
class SpotCheckFailure:
    username: str
    fingerprint: str  # of the peer key (app.runs.fingerprints)
    epoch: int
    evidence: str


@dataclass(frozen=True)
class SpotCheckSummary:
    """What organizers see: checks done and passed, and every failure with its evidence, newest first."""

    checked: int
    passed: int
    failures: list[SpotCheckFailure]


def summary(session: Session, run: Run, limit: int = 100) -> SpotCheckSummary:
    from app.runs.fingerprints import fingerprint

    counts = dict(session.execute(select(SpotCheck.passed, func.count()).where(SpotCheck.run_id == run.id)
                                  .group_by(SpotCheck.passed)).all())
    failures = [SpotCheckFailure(row.username, fingerprint(row.peer_key), row.epoch, row.evidence)
                for row in session.scalars(select(SpotCheck).where(SpotCheck.run_id == run.id,
                                                                   SpotCheck.passed.is_(False))
                                           .order_by(SpotCheck.epoch.desc()).limit(limit))]
    passed = int(counts.get(True, 0))
    return SpotCheckSummary(passed + int(counts.get(False, 0)), passed, failures)
