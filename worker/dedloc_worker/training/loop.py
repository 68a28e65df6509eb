"""The training loop of one worker: local mini-steps, collaborative steps, signed metrics, progress display."""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
from dedloc_common.contract import (
    RECENT_EPOCHS_KEPT,
    EpochContribution,
    LinkReport,
    MemoryReport,
    MetricsRecord,
    RunConfig,
    mean_loss,
    peer_key_of_subkey,
)

from dedloc_worker.errors import TrainingError, WorkerError
from dedloc_worker.swarm.records import METRICS_INTERVAL, MetricsPublisher, publish_metrics
from dedloc_worker.tasks.adapters import trainable
from dedloc_worker.training.optimizer import LEAVE_GRACE, RoundReceipts
from dedloc_worker.training.options import create_optimizer, restore, state_averaging_period
from dedloc_worker.training.spot_checks import GradientSum, checkable, epoch_seed

AUX_POLL = 0.2  # seconds an auxiliary peer waits between two looks for a round to aggregate
FINAL_WAIT = 600.0  # seconds a peer at the run's target serves its state for the final checkpoint, at most


@dataclass
class EpochTally:
    """Loss and time of the mini-steps taken while the local epoch was ``epoch``."""

    epoch: int
    loss_sum: float = 0.0
    mini_steps: int = 0
    compute_seconds: float = 0.0  # forward and backward passes
    started: float = field(default_factory=time.monotonic)
    gradients: Optional[GradientSum] = None  # for the sketch spot checks compare; None when the task is uncheckable


def open_epoch(task, config: RunConfig, peer_key: str, epoch: int) -> EpochTally:
    """A new tally; a checkable task draws the epoch's batches from (run seed, peer key, epoch) from here on. Local
    updates are not spot-checked (docs/spot-checks.md#local-updates): their epochs carry no sketch."""
    if not checkable(task) or config.optimizer.algorithm != "large-batch":
        return EpochTally(epoch)
    task.reseed(epoch_seed(config.seed, peer_key, epoch))
    return EpochTally(epoch, gradients=GradientSum(config.seed))


@dataclass
class TrainingResult:
    contributions: List[EpochContribution]
    final_epoch: int
    state: dict
    username: str = ""
    peer_id: str = ""
    finished: bool = False  # the run reached its target (or its organizers ended it)
    link: Optional[LinkReport] = None  # the last link report: the vector's size, the last round's bytes


@dataclass
class Status:
    """What the progress display shows after each mini-step."""

    epoch: int
    local_samples_per_second: float
    swarm_samples_per_second: float
    loss: Optional[float]
    peers: int


def train(
    dht,
    config: RunConfig,
    task,
    username: str,
    stop: threading.Event,
    signature,
    max_epochs: Optional[int] = None,
    client_mode: bool = False,
    on_status: Callable[[Status], None] = lambda status: None,
    receipts=None,
    follower=None,
    aux: bool = False,
    hardware: str = "",
    watch=None,
    resume: Optional[dict] = None,
    reachability: str = "",
    admitted_at: float = 0.0,
    outbox=None,
    expired: Optional[threading.Event] = None,
    micro_batch: Optional[int] = None,
    memory: Optional[MemoryReport] = None,
) -> TrainingResult:
    """Train until ``stop`` is set or the collaboration reaches ``max_epochs``; always leaves the swarm.

    :param signature: the ``RSASignatureValidator`` this peer's records are signed with
    :param receipts: a ``credit.receipts.ReceiptLog`` of the gradient parts this peer aggregated
    :param follower: a ``averaging.planning.PlanFollower``: applies the coordinator's averaging plan, reports the link
    :param aux: an auxiliary peer: computes nothing, aggregates its share of every round
    :param hardware: where it trains, in words (``training.device.Placement.description``)
    :param watch: a ``portal.client.RunWatch``: the run's state (paused, finished) as the portal says it now
    :param resume: a checkpoint's training state to start from (``training.checkpoints.read_state``)
    :param outbox: the ``credit.outbox.ClaimOutbox`` every metrics record goes through (None: records carry the
      loop's recent claims alone)
    :param reachability: how this peer's mode was decided (``contract.REACHABILITY``), for its metrics record
    :param admitted_at: ``time.monotonic()`` from which peers know this peer's token: no call to them before it
    :param micro_batch: samples per forward and backward (``memory.choose_micro_batch``: ``config.batch_size``, or
      fewer where that does not fit this device; ``mini_step``)
    :param memory: what this run needs in memory on this peer's device, for its metrics record (the join page)
    :param expired: set while this peer's token has expired and cannot be renewed (``admission.keeper``): peers
      refuse it, so it trains nothing meanwhile
    :returns: this peer's contributions (samples per epoch it took part in) and its final parameters
    """
    addrs = [] if client_mode else [str(addr) for addr in dht.get_visible_maddrs()]
    hardware = hardware or describe_hardware()
    opt = create_optimizer(dht, config, trainable(task.model), client_mode=client_mode, aux=aux, receipts=receipts,
                           leave=stop, plan_authority=follower.authority if follower else None)
    if resume is not None:
        restore(opt, resume)
    time.sleep(max(0.0, admitted_at - time.monotonic()))
    scaler = grad_scaler(task)
    contributions: deque = deque(maxlen=RECENT_EPOCHS_KEPT)
    every_contribution: List[EpochContribution] = []
    peer_key = peer_key_of_subkey(signature.local_public_key)
    tally = open_epoch(task, config, peer_key, opt.local_epoch)
    run_over = paused = False
    unsettled: deque = deque()  # claims of finished epochs whose rounds are still running (delayed updates)
    link = follower.link if follower else None
    # an auxiliary peer counts as online while its record is fresh (metadata_expiration): it is stored well within
    publisher = MetricsPublisher(functools.partial(publish_metrics, dht, config.run_id, signature, outbox=outbox),
                                 interval=min(METRICS_INTERVAL, config.optimizer.metadata_expiration / 3))

    def publish() -> None:  # the record as things stand: the claims settled so far and the newest link report
        publisher.submit(metrics_record(username, opt, contributions, addrs, hardware, link, reachability, memory))

    try:
        # The first record goes out now, not after the first epoch: with the link measured at join in it, the
        # coordinator plans with this peer epochs sooner (in a swarm of 2.5 s epochs a joiner's first planned round
        # came four epochs after its join, and on a faster machine none came within a test's nine).
        publish()
        while not stop.is_set():
            target = watch.target_epochs if watch is not None else config.target_epochs
            if target is not None and epoch_of(opt, aux) >= target:
                run_over = True
                await_final_checkpoint(watch, stop)
                break
            if max_epochs is not None and epoch_of(opt, aux) >= max_epochs:
                break
            if watch is not None and watch.state == "finished":
                run_over = True
                break
            held = expired is not None and expired.is_set()  # the keeper said why in a line
            if held or watch is not None and watch.state != "active":
                if not paused and not held:
                    print("the run is paused by its organizers: training nothing, still in the swarm; "
                          "training resumes when they resume it", flush=True)
                paused = True
                # Paused: keep the swarm connection, train nothing; the round of the last epoch may still end
                # and its claim be published (below), so the pause holds no credit back. The pause is no training
                # time: counted, it cut the rate this peer reports to ~15 samples/s, ~30 s of training to recover.
                with opt.tracker.performance_ema.pause():
                    stop.wait(watch.interval if watch is not None else 1.0)
            else:
                paused = resumed(paused)
                if aux:
                    opt.step()  # joins the round when the swarm is ready for one
                    stop.wait(AUX_POLL)
                elif not mini_step(task, config, opt, tally, scaler, micro_batch):
                    print(f"float16 gradients overflowed: this epoch's gradients are dropped, the loss scale is now "
                          f"{scaler.get_scale():g}", flush=True)
                    tally = open_epoch(task, config, peer_key, opt.local_epoch)  # redraws the epoch's batches
            opt.collect_rounds()
            while opt.finished_epochs:
                unsettled.append(close_epoch(tally, opt.finished_epochs.pop(0)))  # its round's receipts come next
                link = follower.after_epoch(opt.averager) if follower else None
                if config.optimizer.algorithm == "large-batch":  # local updates average state at every epoch
                    # hivemind reads this attribute at every epoch: it follows the swarm's size
                    opt.average_state_every = state_averaging_period(opt.tracker.global_progress.num_peers,
                                                                     config.optimizer.group_size,
                                                                     config.optimizer.average_state_every)
            settled = take_settled(unsettled, opt.rounds_over)
            if settled:
                contributions.extend(settled)
                every_contribution.extend(settled)
                publish()
            if tally.epoch != opt.local_epoch:
                tally = open_epoch(task, config, peer_key, opt.local_epoch)  # or state reloaded: samples dropped
            if not paused:  # the display counts mini-steps
                last = unsettled[-1] if unsettled else contributions[-1] if contributions else None
                on_status(status_of(opt, last))
        check_finite(task.model)
        # This peer's averager still holds parts of the last round that partners are receiving: leaving at once
        # would fail their round and split the model. A short grace lets it deliver them; the last claims are
        # published within it, once their rounds have ended (or as they stand at its end). It runs from when a
        # round's wait saw the request to leave, if one did: an auxiliary peer's step spent it there. The next round,
        # scheduled ahead, runs within it too (``begin_leaving``), and the optimizer's shutdown gives a state round
        # still open what is left of it.
        grace_ends = opt.begin_leaving() + LEAVE_GRACE
        while unsettled and len(opt.rounds_over) < len(unsettled) and time.monotonic() < grace_ends:
            time.sleep(0.05)
            opt.collect_rounds()
        settled = take_settled(unsettled, opt.rounds_over, leaving=True)
        if settled:
            contributions.extend(settled)
            every_contribution.extend(settled)
            publish()
        # after the last round (an overlapped outer round is applied as it ends, within the grace)
        state = {k: v.clone() for k, v in task.model.state_dict().items()}
        time.sleep(max(0.0, grace_ends - time.monotonic()))
        return TrainingResult(every_contribution, opt.local_epoch, state, finished=run_over, link=link)
    finally:
        publisher.close(timeout=LEAVE_GRACE)  # on the way out after an error, not held up by a slow store
        opt.shutdown()


def resumed(paused: bool) -> bool:
    """Training (again): says so once after a pause (the organizers', or an expired token's); the new paused flag."""
    if paused:
        print("training resumes", flush=True)
    return False


def await_final_checkpoint(watch, stop: threading.Event, limit: float = FINAL_WAIT) -> None:
    """At the target, keep serving this peer's state until the checkpointer has saved the final model and the
    portal marks the run finished (or ``limit`` seconds pass): leaving at once could leave nobody to download from."""
    if watch is None:
        return
    print("the run reached its target; waiting for the final checkpoint before leaving...", flush=True)
    deadline = time.monotonic() + limit
    while watch.state != "finished" and not stop.is_set() and time.monotonic() < deadline:
        stop.wait(min(watch.interval, 1.0))


def epoch_of(opt, aux: bool) -> int:
    """The epoch this peer is at; an auxiliary peer loads no state, so it goes by the collaboration's."""
    return max(opt.local_epoch, opt.tracker.global_epoch) if aux else opt.local_epoch


def grad_scaler(task):
    """hivemind's gradient scaler where the task trains in float16 (bf16 and fp32 need none)."""
    if getattr(task, "autocast", None) is not torch.float16:
        return None
    from hivemind import GradScaler

    return GradScaler()


def mini_step(task, config: RunConfig, opt, tally: EpochTally, scaler=None, micro_batch: Optional[int] = None) -> bool:
    """One local mini-batch: forward, backward, and hand the gradients to the collaborative optimizer. False when
    float16 gradients overflowed: hivemind then drops every gradient accumulated in the epoch, and the caller starts
    the epoch's tally again (the rejected mini-steps are neither counted nor sketched).

    :param micro_batch: samples per forward and backward where the run's mini-batch does not fit this device at once
      (``memory.choose_micro_batch``; it divides ``config.batch_size``): the mini-batch's gradient is accumulated from
      its micro-batches, each loss scaled by their count, so the step and its sketch are the mini-batch's."""
    began = time.perf_counter()
    parts = config.batch_size // micro_batch if micro_batch else 1
    try:
        value = 0.0
        for _ in range(parts):
            loss = task.batch_loss(config.batch_size // parts) / parts
            (scaler.scale(loss) if scaler is not None else loss).backward()
            value += loss.item()
        tally.compute_seconds += time.perf_counter() - began
    except WorkerError:
        raise
    except Exception as e:  # a task is a plugin: say which one failed, in one line
        raise TrainingError(f"task {config.task!r} failed: {type(e).__name__}: {e}") from e
    if not math.isfinite(value):
        raise TrainingError(f"the loss became {value}; the task or its learning rate is unstable")
    # a large-batch step checks this itself and resets the epoch's gradients (local updates skip the step)
    finite = scaler is None or scaler.are_grads_finite(opt)
    if finite:
        tally.loss_sum += value
        tally.mini_steps += 1
    if config.optimizer.clip_grad_norm:
        # Scaled gradients scale their norm alike: clipping at the scaled bound clips the true gradient at the bound.
        bound = config.optimizer.clip_grad_norm * (scaler.get_scale() if scaler is not None else 1.0)
        torch.nn.utils.clip_grad_norm_(task.model.parameters(), bound)
    if tally.gradients is not None and finite:
        tally.gradients.add(trainable(task.model), scaler.get_scale() if scaler is not None else 1.0)
    if scaler is not None:
        opt.step(grad_scaler=scaler)
        scaler.update()  # hivemind's scaler shrinks its scale here only, after an overflow (and grows it after a step)
    else:
        opt.step()
    opt.zero_grad()
    return finite


def close_epoch(tally: EpochTally, finished) -> EpochContribution:
    """The claim of a finished epoch, without its round's receipts (``take_settled`` adds them)."""
    return EpochContribution(
        epoch=finished.epoch,
        samples=finished.samples,
        loss_sum=float(tally.loss_sum),
        mini_steps=tally.mini_steps,
        seconds=round(time.monotonic() - tally.started, 3),
        compute_seconds=round(tally.compute_seconds, 3),
        sketch=tally.gradients.sketch() if tally.gradients is not None else "",
    )


def take_settled(unsettled: deque, rounds_over: list, leaving: bool = False) -> List[EpochContribution]:
    """The claims whose rounds have ended, with those rounds' receipts (``AccountedOptimizer.rounds_over``, in the
    same order); ``swarm.leaving``: every claim, without receipts where its round has not ended."""
    settled = []
    while unsettled and (rounds_over or leaving):
        receipts = rounds_over.pop(0) if rounds_over else RoundReceipts()
        update = {"group": receipts.group, "aggregated": receipts.aggregated, "attested": receipts.attested}
        if receipts.samples is not None:
            update["samples"] = receipts.samples
        if receipts.sent_bytes is not None:
            update["sent_bytes"] = receipts.sent_bytes
        settled.append(unsettled.popleft().copy(update=update))
    return settled


def describe_hardware() -> str:
    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)}"
    return f"cpu: {torch.get_num_threads()} threads"


def metrics_record(username: str, opt, contributions, addrs: List[str], hardware: str = "",
                   link: Optional[LinkReport] = None, reachability: str = "",
                   memory: Optional[MemoryReport] = None) -> MetricsRecord:
    from hivemind.utils import get_dht_time

    ema = opt.tracker.performance_ema
    return MetricsRecord(
        username=username,
        epoch=opt.local_epoch,
        # 0 until measured (hivemind starts the estimate at 1e-20): the coordinator plans a peer without a rate
        samples_per_second=float(ema.samples_per_second) if ema.num_updates else 0.0,
        time=get_dht_time(),
        recent=list(contributions),
        addrs=addrs,
        hardware=hardware,
        link=link,
        reachability=reachability,
        memory=memory,
    )


def status_of(opt, last: Optional[EpochContribution]) -> Status:
    return Status(
        epoch=opt.local_epoch,
        local_samples_per_second=float(opt.tracker.performance_ema.samples_per_second),
        swarm_samples_per_second=float(opt.tracker.swarm_samples_per_second),
        loss=mean_loss([last]) if last else None,
        peers=opt.tracker.global_progress.num_peers,
    )


def check_finite(model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            raise TrainingError(f"parameter {name} is not finite; the run's state is corrupt, "
                                "restart from a checkpoint")
