"""The spot checker: in the coordinator's process, it picks claims at random, recomputes their gradient on the
peer's own data with the parameters of their epoch, and records the verdict (``app.credit.spot_checks``).

When the swarm reaches a new epoch, each training peer is picked with the run's ``spot_check_rate`` (drawn here,
after the peer computed, so a peer cannot know which of its epochs will be checked). For each one picked, the checker
downloads that peer's own state through the checkpointer's averager (the parameters it computes on in that epoch),
waits for the picked peers' claims of that epoch, redraws their batches (``dedloc_worker.training.spot_checks``) and
compares. A picked claim that cannot be judged (no sketch, or samples that are not whole mini-batches) is recorded and
holds its account like a failure, and a picked claim that never comes is recorded: a peer cannot dodge a check unseen. A
check that holds its account re-decides the account's claims (``enforce_check``), so they are held from then on. One
pick waits at a time: a check costs one peer's epoch of compute and a state download, at most ``rate`` of the swarm's
compute (docs/spot-checks.md). Its model is built at the first pick: a run at rate 0 costs the coordinator
nothing."""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Optional

from dedloc_common.contract import MetricsRecord
from dedloc_common.tasks import run_files
from dedloc_worker.tasks import Task, build_task
from dedloc_worker.tasks.adapters import trainable
from dedloc_worker.training.spot_checks import checkable, recompute
from sqlalchemy.orm import Session

from app.credit.ledger import SignedMetrics
from app.credit.settlement import owners, settle_account
from app.credit.spot_checks import (
    HOLDING_SKIPS,
    NO_CLAIM,
    holds,
    judge,
    loss_step,
    record_check,
    record_skip,
    skip_evidence,
    unusable,
)
from app.models import Run, SpotCheck
from app.runs import files, registry

logger = logging.getLogger("dedloc.spot_checker")
CLAIM_WAIT = 600.0  # seconds a pick waits for the claim of its epoch (a peer that left never sends it)


def enforce_check(session: Session, run: Run, check: Optional[SpotCheck]) -> bool:
    """Commit a check ``record_check`` or ``record_skip`` added; one that holds its account re-decides the account's
    claims first, in the same transaction, so they are held from now on. False where that claim was drawn already
    (``check`` is None)."""
    if check is None:
        return False
    if holds(check):
        settle_account(session, run, check.username)
    session.commit()
    return True


def moved_past(record, epoch: int) -> bool:
    """Whether a peer has claimed a later epoch than ``epoch`` without claiming ``epoch``: claims are published in
    order, so one for ``epoch`` will not come (the peer downloaded the state and skipped it)."""
    return any(c.epoch > epoch for c in record.recent)


class SpotChecker(threading.Thread):
    """``offer(epoch, training, metrics)`` after each poll; ``shutdown()`` once."""

    def __init__(self, checkpointer, sessions, rng: Optional[random.Random] = None):
        super().__init__(name="dedloc-spot-checker", daemon=True)
        self.checkpointer, self.sessions = checkpointer, sessions
        self.config = checkpointer.config
        self.task: Optional[Task] = None  # its own model (the checkpointer's stays as downloaded), built by ``ready``
        self.rng = rng or random.SystemRandom()
        self.planned = -1  # the newest swarm epoch picks were drawn for
        # peer key -> (the epoch whose claim is checked, the parameters of that epoch, whose state they are)
        self.pending: dict[str, tuple[int, list, str]] = {}
        self.deadline = 0.0
        self._latest: Optional[tuple[int, list[str], dict[str, MetricsRecord]]] = None  # what offer() saw last
        self._lock = threading.Lock()
        self._wake, self._halt = threading.Event(), threading.Event()

    def offer(self, epoch: int, training: list[str], metrics: list[SignedMetrics]) -> None:
        """What the last poll saw: the swarm's epoch, the training peers' keys, every metrics record."""
        with self._lock:
            self._latest = (epoch, list(training), {m.peer_key: m.record for m in metrics})
        self._wake.set()

    def run(self) -> None:
        while not self._halt.is_set():
            self._wake.wait(timeout=5.0)
            self._wake.clear()
            with self._lock:
                latest = self._latest
            if self._halt.is_set() or latest is None:
                continue
            try:
                self.step(*latest)
            except Exception as e:  # a failed download or recompute skips this pick; the next epoch draws again
                logger.warning("spot check skipped: %s: %s", type(e).__name__, e)
                self.pending = {}

    def halt(self) -> None:
        self._halt.set()
        self._wake.set()

    def shutdown(self) -> None:
        """Stop; a recomputation stops at its next mini-step (a state download is left to its timeout)."""
        self.halt()
        self.join(timeout=5)

    def step(self, epoch: int, training: list[str], records: dict) -> None:
        if not self.pending:
            self.pick(epoch, training)
        for peer_key, (at, params, source) in list(self.pending.items()):
            record = records.get(peer_key)
            claim = next((c for c in record.recent if c.epoch == at), None) if record is not None else None
            if claim is not None:
                del self.pending[peer_key]
                self.check(peer_key, claim, params, source)
            elif time.monotonic() > self.deadline or (record is not None and moved_past(record, at)):
                del self.pending[peer_key]  # it left, or reloaded its state and skipped that epoch: no claim comes
                self.skip(peer_key, at, NO_CLAIM, skip_evidence(NO_CLAIM))

    def pick(self, epoch: int, training: list[str]) -> None:
        """Draw the peers to check at ``epoch``; for each, download the parameters it computes on: its own state
        (another peer's may have drifted after a round the checked one missed), or the collaboration's where it
        serves none (a client-mode peer)."""
        if epoch <= self.planned:
            return
        self.planned = epoch
        rate = self.checkpointer.options.spot_check_rate
        if self.config.optimizer.algorithm != "large-batch":  # no sketch to recompute (docs/spot-checks.md)
            rate = 0.0
        chosen = [peer_key for peer_key in training if self.rng.random() < rate]
        if not chosen or not self.ready():
            return
        with self.sessions() as session:
            peer_ids = {key: peer_id for key, (_, peer_id) in
                        owners(session, registry.get_run(session, self.config.slug), chosen).items()}
        pending, swarm_state = {}, None
        with self.checkpointer.lock:
            for peer_key in chosen:
                own = self.checkpointer.download_from(peer_ids[peer_key]) if peer_ids.get(peer_key) else None
                if own is not None:
                    pending[peer_key] = (*own, "its own state")
                    continue
                if swarm_state is None and self.checkpointer.download() >= 0:  # once per pick, for every fallback
                    swarm_state = (self.checkpointer.averager.local_epoch, [
                        p.detach().clone() for p in trainable(self.checkpointer.task.model)], "the swarm's state")
                if swarm_state is not None:
                    pending[peer_key] = swarm_state
        if pending:
            self.planned = max(self.planned, *(at for at, _, _ in pending.values()))
            self.pending = pending
            self.deadline = time.monotonic() + CLAIM_WAIT

    def ready(self) -> bool:
        """Whether this checker can check now: a pick made before the checkpointer's averager is built (the poll
        loop builds it once peers train) is skipped; the first that finds it builds this checker's own model. It
        stops, said once, where the run's task cannot be checked."""
        if self.task is not None:
            return True
        with self.checkpointer.lock:
            built = self.checkpointer.built()
        if not built:
            if self.checkpointer.failure is not None:  # it said why
                self.halt()
            return False
        paths = {name: files.path_of(self.checkpointer.data_dir, self.config.slug, name)
                 for name in run_files(self.config.task, self.config.task_options)}
        task = build_task(self.config, paths)
        if not checkable(task):
            print(f"no spot checks for run {self.config.slug!r}: its task ({self.config.task}) does not draw its "
                  "data from a seed it is given", flush=True)
            self.halt()
            return False
        self.task = task
        return True

    def check(self, peer_key: str, claim, params: list, source: str) -> None:
        """Recompute ``claim`` with ``params`` (those of its epoch, from ``source``) and record the verdict."""
        import torch

        kind = unusable(claim.sketch, claim.samples, claim.mini_steps, self.config.batch_size)
        if kind is not None:
            self.skip(peer_key, claim.epoch, kind, skip_evidence(kind, claim.samples, claim.mini_steps,
                                                                 self.config.batch_size),
                      claim.mini_steps, claim.loss_sum / claim.mini_steps if claim.mini_steps else 0.0)
            return
        assert self.task is not None  # claims are pending only once ready() built it
        with torch.no_grad():
            for param, value in zip(trainable(self.task.model), params):
                param.copy_(value)
        started = time.monotonic()
        with self.checkpointer.lock:  # a task may reseed the global RNG, which the checkpointer's evaluation uses
            done = recompute(self.task, self.config, peer_key, claim.epoch, claim.mini_steps, halt=self._halt)
        if done is None:  # the coordinator is stopping
            return
        sketch, loss = done
        seconds = time.monotonic() - started
        claimed_loss = claim.loss_sum / claim.mini_steps
        with self.sessions() as session:
            run = registry.get_run(session, self.config.slug)
            verdict = judge(claim.sketch, sketch, claimed_loss, loss, loss_step(session, run, claim.epoch))
            username = owners(session, run, [peer_key]).get(peer_key, ("(unknown)",))[0]
            enforce_check(session, run, record_check(
                session, run, peer_key=peer_key, username=username, epoch=claim.epoch, mini_steps=claim.mini_steps,
                verdict=verdict, claimed_loss=claimed_loss, recomputed_loss=loss))
        if verdict.passed:  # rare (the run's rate): one line each, with what it cost
            print(f"spot check of {username}'s peer at epoch {claim.epoch} passed (cosine {verdict.cosine:+.2f}, "
                  f"{claim.mini_steps} mini-steps recomputed on {source} in {seconds:.1f} s)", flush=True)
        else:
            print(f"spot check of {username}'s peer at epoch {claim.epoch} failed, its account's credit is held "
                  f"(recomputed on {source}): {verdict.evidence}", flush=True)

    def skip(self, peer_key: str, epoch: int, kind: str, evidence: str, mini_steps: int = 0,
             claimed_loss: float = 0.0) -> None:
        """Record a picked claim that was not judged, and why; one that could not be judged holds its account."""
        with self.sessions() as session:
            run = registry.get_run(session, self.config.slug)
            username = owners(session, run, [peer_key]).get(peer_key, ("(unknown)",))[0]
            enforce_check(session, run, record_skip(
                session, run, peer_key=peer_key, username=username, epoch=epoch, kind=kind, evidence=evidence,
                mini_steps=mini_steps, claimed_loss=claimed_loss))
        held = ", its account's credit is held until an organizer lifts the hold" if kind in HOLDING_SKIPS else ""
        print(f"spot check of {username}'s peer at epoch {epoch} not judged{held}: {evidence}", flush=True)
