"""Spot checks, the verdict: a claim's published gradient sketch against the one the checkpointer recomputed on the
peer's own data (``app/coordinator/spot_checker.py``), and what a failure does to the peer's credit.

``judge`` is a pure function of the two sketches and the two mean losses. A failed check is kept with its evidence
(``SpotCheck``). A drawn claim that cannot be judged (``unusable``: no sketch, or samples that are not whole
mini-batches) is kept too, with why: skipping it would let a peer dodge every check by publishing no sketch. Either
holds every claim of the peer's *account* in the run, now and later, whatever key it signs with
(``settlement.settle`` asks ``account_holds``; the coordinator's spot checker re-decides the account's claims when it
keeps one), until an organizer lifts the hold (``review.lift_holds``): a restarted
worker's new key does not shake it off. The account is the user the peer token was issued to: the only identity
the token table records, and a worker's new device login mints a new credential for the same user. Organizers see
the evidence and the counts on the organize page. docs/spot-checks.md says what a check can and cannot catch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Optional

from dedloc_common.contract import decode_sketch
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.models import Contribution, Run, SpotCheck, max_length
from app.runs.fingerprints import fingerprint

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


# Why a drawn claim was not judged (``SpotCheck.skipped``). The first two hold the account: a claim a check cannot
# judge is one a cheater would send. The last two hold nothing: no claim, no credit to hold.
NO_SKETCH, PARTIAL, NO_CLAIM, NOTHING_CLAIMED = "no sketch", "partial", "no claim", "nothing claimed"
HOLDING_SKIPS = (NO_SKETCH, PARTIAL)
NOT_ACCUSED = "this is not an accusation"


def unusable(sketch: str, samples: int, mini_steps: int, batch_size: int) -> Optional[str]:
    """Why a claim cannot be judged (a ``skipped`` kind), or None: it has a sketch, and its samples are its
    mini-steps' whole batches (a peer that reloaded the swarm's state mid-epoch claims others)."""
    if samples <= 0:
        return NOTHING_CLAIMED
    if not sketch:
        return NO_SKETCH
    if mini_steps <= 0 or samples != mini_steps * batch_size:
        return PARTIAL
    return None


def skip_evidence(kind: str, samples: int = 0, mini_steps: int = 0, batch_size: int = 0) -> str:
    """What a skip says, in words its owner reads: what happened, not what the peer is suspected of."""
    if kind == NO_SKETCH:
        return "it carried no gradient sketch (an old or modified dedloc-worker publishes none)"
    if kind == PARTIAL:
        return (f"its {samples:,} samples are not {mini_steps} whole mini-batches of {batch_size} (as after "
                "reloading the swarm's state mid-epoch)")
    if kind == NO_CLAIM:
        return "no claim of that epoch came (the peer left, or reloaded the swarm's state and skipped the epoch)"
    return "the claim had no samples"


def held_reason(epoch: int, evidence: str, skipped: str = "", own: bool = True) -> str:
    """The reason a claim is held for a check of its account at ``epoch``; ``own``: of the claim's own peer key."""
    whose = "this peer" if own else "another peer of this account"
    if not skipped:
        reason = f"held: {whose} failed a spot check at epoch {epoch}: {evidence}"
    else:
        todo = "update dedloc-worker, then ask" if skipped == NO_SKETCH else "ask"
        reason = (f"held ({NOT_ACCUSED}): a spot check could not judge {whose}'s claim of epoch {epoch}: "
                  f"{evidence}; {todo} the run's organizers to lift the hold")
    return reason[:max_length(Contribution, "reason")]


def record_check(session: Session, run: Run, *, peer_key: str, username: str, epoch: int, mini_steps: int,
                 verdict: Verdict, claimed_loss: float, recomputed_loss: float) -> Optional[SpotCheck]:
    """Add a check's result (once per peer key and epoch), uncommitted: the caller settles a failure's account
    (``holds``) in the same transaction. Returns None when that claim was checked already."""
    return _record(session, run, SpotCheck(
        run_id=run.id, peer_key=peer_key, username=username, epoch=epoch, mini_steps=mini_steps,
        passed=verdict.passed, cosine=verdict.cosine, norm_ratio=verdict.norm_ratio, claimed_loss=claimed_loss,
        recomputed_loss=recomputed_loss, evidence=verdict.evidence[:max_length(SpotCheck, "evidence")]))


def record_skip(session: Session, run: Run, *, peer_key: str, username: str, epoch: int, kind: str,
                evidence: str, mini_steps: int = 0, claimed_loss: float = 0.0) -> Optional[SpotCheck]:
    """Add a drawn claim that was not judged, and why (``kind``, a ``skipped`` value), uncommitted as
    ``record_check``; one that could not be judged (``HOLDING_SKIPS``) holds. None when that claim was drawn already."""
    return _record(session, run, SpotCheck(
        run_id=run.id, peer_key=peer_key, username=username, epoch=epoch, mini_steps=mini_steps, passed=False,
        cosine=0.0, norm_ratio=0.0, claimed_loss=claimed_loss if math.isfinite(claimed_loss) else 0.0,
        recomputed_loss=0.0, skipped=kind, evidence=evidence[:max_length(SpotCheck, "evidence")]))


def _record(session: Session, run: Run, check: SpotCheck) -> Optional[SpotCheck]:
    exists = session.scalar(select(SpotCheck.id).where(SpotCheck.run_id == run.id, SpotCheck.peer_key == check.peer_key,
                                                       SpotCheck.epoch == check.epoch))
    if exists is not None:
        return None
    session.add(check)
    session.flush()
    return check


def holds(check: SpotCheck) -> bool:
    """Whether ``check`` holds its account's claims: failed, or drawn and not judgeable, and not lifted."""
    return not check.passed and check.skipped in ("", *HOLDING_SKIPS) and check.lifted_by is None


@dataclass(frozen=True)
class AccountHold:
    """The check that holds an account's claims: its peer key, epoch, and what it found."""

    peer_key: str
    epoch: int
    skipped: str
    evidence: str

    def reason_for(self, peer_key: str) -> str:
        return held_reason(self.epoch, self.evidence, self.skipped, own=peer_key == self.peer_key)


def account_holds(session: Session, run: Run, usernames: Iterable[str]) -> dict[str, AccountHold]:
    """username -> the check holding that account in ``run`` (a failure before a skip, then the earliest), for
    those of ``usernames`` with one no organizer lifted."""
    query = select(SpotCheck).where(
        SpotCheck.run_id == run.id, SpotCheck.passed.is_(False), SpotCheck.lifted_by.is_(None),
        SpotCheck.skipped.in_(["", *HOLDING_SKIPS]), SpotCheck.username.in_(list(set(usernames)))
    ).order_by(SpotCheck.skipped != "", SpotCheck.epoch)
    found: dict[str, AccountHold] = {}
    for check in session.scalars(query):
        found.setdefault(check.username, AccountHold(check.peer_key, check.epoch, check.skipped, check.evidence))
    return found


@dataclass(frozen=True)
class SpotCheckFailure:
    """A check that holds (or held) an account: failed, or drawn and not judgeable (``skipped``)."""

    username: str
    fingerprint: str  # of the peer key (app.runs.fingerprints)
    epoch: int
    evidence: str
    skipped: str = ""
    lifted_by: Optional[str] = None


@dataclass(frozen=True)
class SpotCheckSummary:
    """What organizers see: claims drawn, judged and passed; drawn claims not judged, by why; and every check that
    holds (or held) an account, with its evidence, newest first."""

    checked: int
    passed: int
    failures: list[SpotCheckFailure]
    skipped: dict[str, int] = field(default_factory=dict)  # ``skipped`` kind -> drawn claims

    @property
    def drawn(self) -> int:
        return self.checked + sum(self.skipped.values())

    @property
    def undecidable(self) -> int:
        """Drawn claims that could not be judged and hold their account."""
        return sum(self.skipped.get(kind, 0) for kind in HOLDING_SKIPS)


def summary(session: Session, run: Run, limit: int = 100) -> SpotCheckSummary:
    counts = session.execute(select(SpotCheck.skipped, SpotCheck.passed, func.count()).where(
        SpotCheck.run_id == run.id).group_by(SpotCheck.skipped, SpotCheck.passed)).all()
    judged = {passed: int(n) for kind, passed, n in counts if not kind}
    skipped: dict[str, int] = {}
    for kind, _, n in counts:
        if kind:
            skipped[kind] = skipped.get(kind, 0) + int(n)
    failures = [SpotCheckFailure(row.username, fingerprint(row.peer_key), row.epoch, row.evidence, row.skipped,
                                 row.lifted_by)
                for row in session.scalars(select(SpotCheck).where(
                    SpotCheck.run_id == run.id, SpotCheck.passed.is_(False),
                    SpotCheck.skipped.in_(["", *HOLDING_SKIPS])).order_by(SpotCheck.epoch.desc()).limit(limit))]
    passed = judged.get(True, 0)
    return SpotCheckSummary(passed + judged.get(False, 0), passed, failures, skipped)
