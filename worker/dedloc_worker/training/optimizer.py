"""The large-batch collaborative optimizer: hivemind's ``Optimizer`` that accounts for each step's samples and
round (the claims and their receipts), and leaves within a grace."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, field
from typing import List, Optional

import hivemind

# Seconds a leaving peer serves the round it just finished (``training.loop.train``) or one its group formed for as it
# left (hivemind's Optimizer.shutdown would wait an averaging timeout): partners receive its parts, and Ctrl-C stays
# quick
LEAVE_GRACE = 2.0
ROUND_OUTCOME_WAIT = 2.0  # seconds to wait for the averager's account of a round (its process answers in ms)


@dataclass
class FinishedEpoch:
    """One collaboration step this peer took part in: the epoch it closed and the samples it averaged in."""

    epoch: int
    samples: int


@dataclass
class RoundReceipts:
    """What the receipt log held once an epoch's round had ended (``credit.receipts.ReceiptLog.drain``): the round this
    peer joined ("" if none formed), the parts it aggregated and what it cut from their senders."""

    group: str = ""
    aggregated: dict = field(default_factory=dict)
    attested: dict = field(default_factory=dict)
    samples: Optional[int] = None  # the samples the round averaged in, where known only once it ended (local updates)
    sent_bytes: Optional[int] = None  # payload bytes this peer sent in the round; None where it formed none here


class AccountedOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` that remembers how many local samples went into each global step, and which round.

    hivemind weights this peer's gradients by ``grad_averager.local_samples_accumulated`` when it averages, so
    that number, read as the epoch closes, is exactly this peer's contribution to the step. Samples discarded
    because the peer fell out of sync never reach it.

    Each finished epoch gets its round's receipts in ``rounds_over``, in order, once the round has ended: at once
    without delayed updates, and during the next epoch with them, where the round runs in the background. They
    are taken before the next round begins, so a claim is never tied to the round after its own.
    """

    def __init__(self, *args, receipts=None, leave: Optional[threading.Event] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.receipts = receipts  # a receipts.ReceiptLog, or None: every round's receipts are empty
        self.finished_epochs: List[FinishedEpoch] = []
        self.rounds_over: List[RoundReceipts] = []
        self._round_running = False
        self._leaving = False
        self.leave = leave or threading.Event()  # set when the peer is asked to leave (Ctrl-C), and at shutdown
        # time.monotonic() when this peer was first seen leaving (a round's wait, the trainer's grace or shutdown):
        # every wait of a leaving peer ends LEAVE_GRACE after it
        self.leave_seen_at: Optional[float] = None

    @property
    def averager(self):
        """The averager the coordinator's plan applies to: the gradient averager (``LocalUpdatesOptimizer``: the
        outer one)."""
        return self.grad_averager

    def _make_progress_tracker(self, target_batch_size: int, **kwargs):
        from dedloc_worker.training.tracker import ThrottledProgressTracker

        return ThrottledProgressTracker(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                                        client_mode=self.client_mode, status_loglevel=self.status_loglevel,
                                        start=True, **kwargs)

    def _maybe_schedule_state_averaging(self) -> None:
        """Periodic state rounds are not scheduled ahead of their step (docs/hivemind.md#pitfalls, 20: first
        thought to cause the parts lost at state-averaging steps, whose cause was pitfall 22); hivemind then matches
        the state round in that step's background work, beside its gradient round. Where state is averaged at every
        step (a swarm larger than one group, ``state_averaging_period``), that would add a matchmaking to every
        step's background work, so hivemind's schedule stays."""
        if self.average_state_every == 1:
            super()._maybe_schedule_state_averaging()

    def collect_rounds(self) -> None:
        """Take the last epoch's receipts if its round has ended (call between mini-steps)."""
        if self._round_running and not (self.delay_grad_averaging and self._update_pending()):
            self._take_receipts()

    def _update_pending(self) -> bool:
        """Whether the last step's background work (its round, then its update) is still running."""
        return not all(update.done() for update in self.state_averager.pending_updates)

    def _take_receipts(self, samples: Optional[int] = None) -> None:
        group, aggregated = self.receipts.drain() if self.receipts is not None else (None, {})
        attested = self.receipts.take_attested() if self.receipts is not None else {}
        if samples is None and group and self.receipts.own_weight == 0:
            # it tagged along with weight 0 (caught up with the swarm meanwhile, its gradients dropped): the round
            # carried none of its samples, so the claim says so (it read as a dispute with the aggregators' 0)
            samples = 0
        self.rounds_over.append(RoundReceipts(group or "", aggregated, attested, samples, self._sent_bytes(group)))
        self._round_running = False

    def _sent_bytes(self, group: Optional[str]) -> Optional[int]:
        """Payload bytes this peer sent in round ``group`` (hex), if that is its averager's last round."""
        if not group:
            return None
        try:
            outcome = self.averager.last_round(timeout=ROUND_OUTCOME_WAIT)
        except Exception:  # the averager is gone (leaving) or busy: the claim goes without it
            return None
        return outcome.transfers.sent if outcome is not None and outcome.group == group else None

    def shutdown(self) -> None:
        self._leaving = True
        self.leave.set()
        # hivemind's shutdown first waits for the delayed update, and with it for a state-averaging round running
        # in the background, up to the averaging timeout: one whose partners left too ends at LEAVE_GRACE instead.
        self.leave_seen_at = self.leave_seen_at or time.monotonic()
        cut = threading.Timer(self._grace_left(), self.state_averager.cancel_open_rounds)
        cut.daemon = True
        cut.start()
        try:
            self._shutdown_as_hivemind()
        finally:
            cut.cancel()

    def _shutdown_as_hivemind(self) -> None:
        """hivemind 1.1.12's ``Optimizer.shutdown``, leaving alone a round that is over already: hivemind cancels a
        round still looking for its group, and one this peer cancelled meanwhile (``_wait_or_leave``, the leave
        timer) can still read as looking for a moment; cancelled twice, it raised out of the worker's exit (once in
        four training-bench runs)."""
        from hivemind.averaging.control import AveragingStage

        self.tracker.shutdown(self.shutdown_timeout)
        self.state_averager.step(wait_for_delayed_updates=True)
        for scheduled_round in self.scheduled_grads, self.scheduled_state:
            if scheduled_round is None or scheduled_round.done():
                continue
            if scheduled_round.stage == AveragingStage.LOOKING_FOR_GROUP:
                try:
                    scheduled_round.cancel()
                except InvalidStateError:  # cancelled meanwhile, by the leave timer above
                    pass
            else:
                self._tag_along_with_zero_weight(scheduled_round)
        self.state_averager.shutdown()
        if self.use_gradient_averaging:
            self.grad_averager.shutdown()

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control) -> None:
        if maybe_step_control is not None:
            self._wait_or_leave(maybe_step_control)
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)

    def _wait_or_leave(self, control) -> None:
        """Wait for a gradient round as hivemind does (up to the averaging timeout); once the peer is asked to leave,
        ``LEAVE_GRACE`` more at most, then cancel it. hivemind would wait the whole timeout (60 s by default) for
        partners that are often leaving too, in the main thread of an auxiliary peer or in its shutdown (which waits
        for the update that waits for this round, under delayed updates): Ctrl-C took 10-12 s with 10 s there."""
        deadline, asked = time.monotonic() + self.averaging_timeout, None
        while True:
            now = time.monotonic()
            if asked is None and self.leave.is_set():
                asked = self.leave_seen_at = self.leave_seen_at or now
            if now >= deadline or (asked is not None and now - asked >= LEAVE_GRACE):
                control.cancel()  # hivemind's result() then raises, and this peer steps with its own gradients
                return
            try:
                control.exception(timeout=0.05)  # returns as the round ends, however it ended
            except TimeoutError:
                continue
            except BaseException:  # cancelled: hivemind's result() says so
                pass
            return

    def begin_leaving(self) -> float:
        """The peer stops training (Ctrl-C): its grace (``LEAVE_GRACE``) starts now, and the next gradient round,
        scheduled ahead, fits in it. Still looking for its group, the round is cancelled, so that no group forms
        with a peer that is going; with its group formed, it runs now with zero weight, not after the grace as
        hivemind's shutdown would run it (Ctrl-C took up to 3.0 s, docs/benchmarks.md#leaving). Returns when the
        grace began (``time.monotonic``)."""
        from hivemind.averaging.control import AveragingStage

        self.leave.set()
        self.leave_seen_at = min(time.monotonic(), self.leave_seen_at or math.inf)
        scheduled = self.scheduled_grads
        if scheduled is not None and not scheduled.done():
            if scheduled.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
                try:
                    scheduled.cancel()
                except InvalidStateError:  # it found its group meanwhile: shutdown tags along
                    pass
            else:
                _run_with_zero_weight(scheduled)
        return self.leave_seen_at

    def _grace_left(self) -> float:
        """Seconds left of a leaving peer's grace, from when it first saw the request to leave (now if not yet)."""
        return max(0.0, (self.leave_seen_at or time.monotonic()) + LEAVE_GRACE - time.monotonic())

    def _tag_along_with_zero_weight(self, control) -> None:
        """hivemind joins a round this peer's group formed for with zero weight, and waits up to the averaging
        timeout for it (60 s by default); a leaving peer waits until its grace ends."""
        if not self._leaving:
            return super()._tag_along_with_zero_weight(control)
        _run_with_zero_weight(control)
        try:
            control.result(self._grace_left())
        except BaseException:  # the round failed or ran past the wait: either way this peer is leaving
            if not control.done():
                control.cancel()

    def _update_global_epoch(self, grad_scaler) -> None:
        if self._round_running:  # under delayed updates: the previous round ends before the next one begins
            self.state_averager.step(wait_for_delayed_updates=True)  # as hivemind's step does first thing
            self._take_receipts()
        samples = self.grad_averager.local_samples_accumulated
        super()._update_global_epoch(grad_scaler)
        # The step leads to the collaboration's next epoch; a peer that lagged one behind jumps two, so the
        # step is named by where it leads (minus one), the same number on every peer that took part.
        self.finished_epochs.append(FinishedEpoch(self.local_epoch - 1, samples))
        self._round_running = True
        self.collect_rounds()  # without delayed updates the round is over already


def _run_with_zero_weight(control) -> None:
    """Let a round this peer's group formed for run now, this peer's gradients weighing nothing (as hivemind's
    ``_tag_along_with_zero_weight`` begins)."""
    if not control.triggered:
        control.weight = 0
        control.allow_allreduce()
