"""The run's options as hivemind's arguments: ``create_optimizer`` and what it builds from, ``restore`` from a
checkpoint.

The pitfalls (docs/hivemind.md#pitfalls, same numbers) and where each is handled (``AccountedOptimizer``:
``training.optimizer``):
1. ``client_mode`` is passed to the Optimizer explicitly, always (``create_optimizer``).
2. Gradient-averager options go through ``grad_averager_factory``, not ``averager_opts`` (``create_optimizer``).
3. Child processes outliving their parent: the worker ends every process it started as it exits
   (``dedloc_common.cleanup.end_descendants``, in ``session.run_join``).
4. Exceptions in the training loop: ``training.loop.train`` shuts the optimizer and the DHT down in ``finally``.
5. Signed records need the validators registered on the reader too (``swarm.records.add_record_validators``).
6. A group whose senders all weigh 0 (an auxiliary peer and a trainer that just reloaded state) averages to NaN:
   ``averaging.planned.guard_weightless_parts`` (``create_optimizer``).
7. Starting an averager sets SIGINT to "ignore" in the *calling* process (``run_in_background``), so Ctrl-C no
   longer stops the worker: ``create_optimizer`` puts the caller's handler back.
10. Progress stored after every mini-step: ``training.tracker.ThrottledProgressTracker`` (``_make_progress_tracker``).
11. Matchmaking reads the group key back to back while it waits: ``averaging.matchmaking.pace_matchmaking``
    (``create_optimizer``, before the averagers fork).
12. State averaging at every step: ``average_state_every`` from the run's options (``create_optimizer``).
13. A full garbage collection stalls a process for 0.2-0.5 s, longest in a forked child (it writes to every object
    it inherited): ``gc.freeze`` before each fork (``swarm.node.create_dht``, ``create_optimizer``) and in the gradient
    averager's own process (``averaging.planned.PlannedAverager.run``).
14. A DHT request from a process that left before the DHT process read it (an averager at shutdown) cannot be
    unpacked: hivemind logged a traceback and slept 3 s for each, which held up its own shutdown past its grace
    period. ``swarm.node.SwarmDHT`` drops such a request (``swarm.node.create_dht``, and the coordinator's node).
15. An averager renews its DHT record as a state source after every tensor a round averages: a signed store each,
    7-8 a second per worker. ``averaging.state_sharing.DeclaresOnChange`` renews it on its period and on a change only,
    a change at most every ``PRIORITY_SPACING`` seconds (the state averager, through ``declare_state_on_change`` in
    ``create_optimizer``); the gradient averager is no state source (``averaging.planned.PlannedGradientAverager``).
16. An auxiliary peer that averages in the background (``delay_grad_averaging``) fails at its first epoch: it takes
    no step, and hivemind asserts that its averaging trigger needs one. ``create_optimizer`` delays nothing there.
17. Under delayed updates an epoch's round runs during the next epoch: its receipts are taken once it is over and
    before the next round begins (``AccountedOptimizer.rounds_over``), not at the epoch's end.
18. ``Optimizer.shutdown`` waits up to the averaging timeout for a round it tags along with; a leaving
    ``AccountedOptimizer`` waits ``LEAVE_GRACE``.
20. Periodic state rounds are not scheduled ahead: ``AccountedOptimizer._maybe_schedule_state_averaging``.
22. A round that missed its group forms with the partners' next round, for good:
    ``averaging.matchmaking.PacedMatchmaking`` gives up on it; ``AccountedOptimizer._shutdown_as_hivemind`` does not
    cancel a round twice.
23. A new epoch reported with 0 samples after a steady epoch is not stored:
    ``training.tracker.ThrottledProgressTracker`` reports it with its first samples.
24. An averager's shutdown with a round under way raised: ``swarm.leaving.EndsRunningRounds`` (both averagers).
25. Every store looks its key up again: ``swarm.node.SwarmDHT``'s node reuses a store's lookup (``swarm.lookups``).
27. The swarm's rate is in no tracker field: ``ThrottledProgressTracker.swarm_samples_per_second``.
28. A report's rate is hivemind's average of the last ~10 mini-steps: ``training.tracker.SteadyRate`` in
    ``ThrottledProgressTracker``.
"""

from __future__ import annotations

import functools
import gc
import signal
import threading
from typing import Optional

from dedloc_common.contract import GRADIENT_PART_BYTES, RunConfig, outer_batch_of

from dedloc_worker.errors import ConfigError
from dedloc_worker.training.local_updates import LocalUpdatesOptimizer
from dedloc_worker.training.optimizer import AccountedOptimizer


def inner_optimizer(options):
    """The run's optimizer as hivemind wants it: a factory of params (the checkpointer builds the same one)."""
    import torch

    if options.name == "lamb":
        from pytorch_optimizer import Lamb

        return functools.partial(Lamb, lr=options.lr, weight_decay=options.weight_decay)
    if options.name == "adamw-8bit":  # moments in 8 bits: a quarter of their memory (Dettmers et al. 2022)
        bnb = quantization_library("optimizer adamw-8bit")
        return functools.partial(bnb.optim.AdamW8bit, lr=options.lr, weight_decay=options.weight_decay)
    if options.name == "adam":
        return functools.partial(torch.optim.Adam, lr=options.lr, weight_decay=options.weight_decay)
    return functools.partial(torch.optim.AdamW, lr=options.lr, weight_decay=options.weight_decay)


def quantization_library(what: str):
    """bitsandbytes, or ``ConfigError`` in one line saying how to install it (an optional extra of the worker)."""
    try:
        import bitsandbytes
    except ImportError:
        raise ConfigError(f"this run's {what} needs bitsandbytes: pip install 'bitsandbytes>=0.48'") from None
    return bitsandbytes


def scheduler_factory(options):
    """Linear warm-up over ``warmup_epochs``, then linear decay to 0 over ``decay_epochs``; hivemind steps it once
    per epoch. None when neither is set."""
    import torch

    if not options.warmup_epochs and not options.decay_epochs:
        return None
    warmup, decay = options.warmup_epochs, options.decay_epochs

    def factor(epoch: int) -> float:
        if epoch < warmup:
            return (epoch + 1) / (warmup + 1)
        if decay:
            return max(0.0, 1.0 - (epoch - warmup) / decay)
        return 1.0

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def gradient_compression(options):
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

    return {"fp16": Float16Compression, "uint8": Uniform8BitQuantization}.get(options.compression, NoCompression)()


def create_optimizer(dht, config: RunConfig, params, client_mode: bool, aux: bool = False, verbose: bool = False,
                     receipts=None, leave: Optional[threading.Event] = None, plan_authority=None):
    """The run's collaborative optimizer over ``params``, configured from the run config.

    :param aux: an auxiliary peer: it aggregates its share of every round and trains nothing
    :param receipts: the ``credit.receipts.ReceiptLog`` its rounds are noted in (``AccountedOptimizer.rounds_over``)
    :param leave: set when the peer is asked to leave: a round it waits for gets ``LEAVE_GRACE`` more
    :param plan_authority: the run's authority key: the gradient averager checks its peers' announced shares against
      the plans it signed (``averaging.planned.PlannedAverager``'s ``authority``)
    """
    from dedloc_worker import patches
    from dedloc_worker.averaging.planned import PlannedGradientAverager
    from dedloc_worker.averaging.state_sharing import state_clip

    patches.install()  # pitfalls 6 and 11, state sharing (the caller installed the gate and receipts)
    gc.freeze()  # pitfall 13: the model and the loaded libraries, before the averagers fork

    opt = config.optimizer
    delay = not aux  # pitfall 16: an auxiliary peer takes no step, so it has no update to delay
    # hivemind warns (and can deadlock) when a request may outlive matchmaking; both averagers get this.
    # target_group_size: a leader starts its round once the group holds this many peers, so a larger swarm averages
    # in groups of at most this many (docs/averaging.md#groups).
    averager_opts = dict(request_timeout=opt.matchmaking_time / 2, target_group_size=opt.group_size)
    attest = receipts.note_attestation if receipts is not None else None
    on_interrupt = signal.getsignal(signal.SIGINT)
    if opt.algorithm == "local-updates":

        optimizer = LocalUpdatesOptimizer(
            dht=dht, run_id=config.run_id, params=params, optimizer=inner_optimizer(opt),
            scheduler=scheduler_factory(opt), target_batch_size=outer_batch_of(opt, config.target_batch_size),
            batch_size_per_step=None if aux else config.batch_size, matchmaking_time=opt.matchmaking_time,
            averaging_timeout=opt.averaging_timeout, next_chunk_timeout=opt.next_chunk_timeout,
            state_averaging_compression=gradient_compression(opt), client_mode=client_mode, auxiliary=aux,
            # the outer rounds are planned, checked, clipped and noted like large-batch gradient rounds
            outer_averager_opts=dict(outer_lr=opt.outer_lr, outer_momentum=opt.outer_momentum,
                                     part_size_bytes=GRADIENT_PART_BYTES, robust=robust_rule(config),
                                     authority=plan_authority, attest=attest, **averager_opts),
            tracker_opts=dict(metadata_expiration=opt.metadata_expiration), verbose=verbose, receipts=receipts,
            leave=leave, overlap=opt.overlap_outer_rounds)
        signal.signal(signal.SIGINT, on_interrupt)  # pitfall 7
        return optimizer
    optimizer = AccountedOptimizer(
        dht=dht,
        run_id=config.run_id,
        params=params,
        optimizer=inner_optimizer(opt),
        scheduler=scheduler_factory(opt),
        target_batch_size=config.target_batch_size,
        batch_size_per_step=None if aux else config.batch_size,
        matchmaking_time=opt.matchmaking_time,
        averaging_timeout=opt.averaging_timeout,
        average_state_every=opt.average_state_every,
        next_chunk_timeout=opt.next_chunk_timeout,
        delay_optimizer_step=opt.delay_optimizer_step and delay,
        delay_grad_averaging=opt.delay_grad_averaging and delay,
        grad_compression=gradient_compression(opt),
        # Pitfall 1: a client-mode DHT with an implicit Optimizer client_mode crashes at the first epoch.
        client_mode=client_mode,
        auxiliary=aux,
        # Pitfall 2: averager_opts reach only the state averager; the gradient averager gets them here, and it is
        # the one that applies the coordinator's averaging plan.
        grad_averager_factory=functools.partial(PlannedGradientAverager, part_size_bytes=GRADIENT_PART_BYTES,
                                                robust=robust_rule(config), authority=plan_authority,
                                                **averager_opts, attest=attest),
        # state rounds average parameters with the run's robust rule too (docs/averaging.md#state-rounds)
        averager_opts=dict(averager_opts, state_clip=state_clip(config)),
        tracker_opts=dict(metadata_expiration=opt.metadata_expiration),
        verbose=verbose,
        receipts=receipts,
        leave=leave,
    )
    signal.signal(signal.SIGINT, on_interrupt)  # pitfall 7
    return optimizer


def state_averaging_period(num_peers: int, group_size: int, configured: int) -> int:
    """Steps between two state averagings. A swarm larger than ``group_size`` averages gradients in groups, and
    only state averaging mixes parameters across them (docs/averaging.md#groups): every step then. Within one group
    every peer takes the same step, and ``configured`` (``OptimizerOptions.average_state_every``) holds."""
    return 1 if num_peers > group_size else configured


def robust_rule(config: RunConfig):
    """The run's ``averaging.robust.RobustRule``, or None where it averages with the plain mean. The cap's grace is one
    matchmaking time: the most a sender's epoch can have begun before the aggregator's; its clock runs from the
    previous round's start where senders accumulate during rounds."""
    from dedloc_worker.averaging.robust import RobustRule

    opt = config.optimizer
    if opt.aggregation == "mean":
        return None
    overlapped = opt.overlap_outer_rounds if opt.algorithm == "local-updates" else opt.delay_grad_averaging
    return RobustRule(tau=opt.clip_radius, iterations=opt.clip_iterations,
                      ceiling=config.samples_per_second_ceiling, grace=opt.matchmaking_time, overlapped=overlapped)


def restore(optimizer, state: dict) -> None:
    """Put a checkpoint's training state (``training.checkpoints.read_state``) into a fresh optimizer, as hivemind's own
    ``TrainingStateAverager.load_state_from_peers`` does after a download
    (docs/hivemind.md#state-checkpoints-and-resume)."""
    import torch

    averager = optimizer.state_averager
    if hasattr(averager, "outer"):  # local updates: the outer state; the inner optimizer starts afresh
        outer = state.get("outer")
        if outer is None:
            raise ConfigError("the checkpoint holds no outer optimizer state: it comes from a large-batch run")
        try:
            averager.outer.load(state["parameters"], outer["momentum"])
        except ValueError as e:
            raise ConfigError(f"{e}: the checkpoint belongs to another model") from e
        averager.outer.restart(averager.main_parameters)
        averager.rounds = int(outer.get("rounds", 0))
        averager.local_epoch = averager.outer_epoch = int(state["epoch"])
        averager._update_scheduler()
        return
    params = [p for group in averager.optimizer.param_groups for p in group["params"]]
    if len(params) != len(state["parameters"]):
        raise ConfigError(f"the checkpoint holds {len(state['parameters'])} tensors, this run's model {len(params)}; "
                          "it belongs to another model")
    with torch.no_grad(), averager.lock_averaged_tensors:
        averager.optimizer.load_state_dict(state["optimizer"])
        for param, saved in zip(params, state["parameters"]):
            param.copy_(saved)
    if averager.offload_optimizer:
        averager._apply_optimizer_parameters_()
    if not averager.reuse_tensors:
        averager._load_local_tensors_into_averager_()
    averager.local_epoch = int(state["epoch"])
    averager._update_scheduler()
