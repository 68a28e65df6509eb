"""Joining a run's swarm: the DHT node and the collaborative optimizer, with hivemind's pitfalls handled.

The pitfalls (docs/hivemind.md#pitfalls, same numbers) and where each is handled:
1. ``client_mode`` is passed to the Optimizer explicitly, always (``create_optimizer``).
2. Gradient-averager options go through ``grad_averager_factory``, not ``averager_opts`` (``create_optimizer``).
3. Child processes outliving their parent: the worker ends every process it started as it exits
   (``dedloc_common.cleanup.end_descendants``, in ``join.run_join``).
4. Exceptions in the training loop: ``trainer.train`` shuts the optimizer and the DHT down in ``finally``.
5. Signed records need the validators registered on the reader too (``records.add_record_validators``).
6. A group whose senders all weigh 0 (an auxiliary peer and a trainer that just reloaded state) averages to NaN:
   ``averaging.guard_weightless_parts`` (``create_optimizer``).
7. Starting an averager sets SIGINT to "ignore" in the *calling* process (``run_in_background``), so Ctrl-C no
   longer stops the worker: ``create_optimizer`` puts the caller's handler back.
10. Progress stored after every mini-step: ``tracker.ThrottledProgressTracker`` (``_make_progress_tracker``).
11. Matchmaking reads the group key back to back while it waits: ``matchmaking.pace_matchmaking``
    (``create_optimizer``, before the averagers fork).
12. State averaging at every step: ``average_state_every`` from the run's options (``create_optimizer``).
13. A full garbage collection stalls a process for 0.2-0.5 s, longest in a forked child (it writes to every object
    it inherited): ``gc.freeze`` before each fork (``create_dht``, ``create_optimizer``) and in the gradient
    averager's own process (``averaging.PlannedAverager.run``).
14. A DHT request from a process that left before the DHT process read it (an averager at shutdown) cannot be
    unpacked: hivemind logged a traceback and slept 3 s for each, which held up its own shutdown past its grace
    period. ``SwarmDHT`` drops such a request (``create_dht``, and the coordinator's node).
15. An averager renews its DHT record as a state source after every tensor a round averages: a signed store each,
    7-8 a second per worker. ``state_sharing.DeclaresOnChange`` renews it on its period and on a change only, a
    change at most every ``PRIORITY_SPACING`` seconds (the state averager, through ``declare_state_on_change`` in
    ``create_optimizer``); the gradient averager is no state source (``averaging.PlannedGradientAverager``).
16. An auxiliary peer that averages in the background (``delay_grad_averaging``) fails at its first epoch: it takes
    no step, and hivemind asserts that its averaging trigger needs one. ``create_optimizer`` delays nothing there.
17. Under delayed updates an epoch's round runs during the next epoch: its receipts are taken once it is over and
    before the next round begins (``AccountedOptimizer.rounds_over``), not at the epoch's end.
18. ``Optimizer.shutdown`` waits up to the averaging timeout for a round it tags along with; a leaving
    ``AccountedOptimizer`` waits ``LEAVE_GRACE``.
20. Periodic state rounds are not scheduled ahead: ``AccountedOptimizer._maybe_schedule_state_averaging``.
22. A round that missed its group forms with the partners' next round, for good: ``matchmaking.PacedMatchmaking``
    gives up on it; ``AccountedOptimizer._shutdown_as_hivemind`` does not cancel a round twice.
23. A new epoch reported with 0 samples after a steady epoch is not stored: ``tracker.ThrottledProgressTracker``
    reports it with its first samples.
24. An averager's shutdown with a round under way raised: ``leaving.EndsRunningRounds`` (both averagers).
25. Every store looks its key up again: ``SwarmDHT``'s node reuses a store's lookup (``dht_lookups``).
27. The swarm's rate is in no tracker field: ``ThrottledProgressTracker.swarm_samples_per_second``.
28. A report's rate is hivemind's average of the last ~10 mini-steps: ``tracker.SteadyRate`` in
    ``ThrottledProgressTracker``.
"""

from __future__ import annotations

import functools
import gc
import math
import signal
import threading
import time
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import hivemind

from dedloc_common.contract import GRADIENT_PART_BYTES, RunConfig


class _StaleRequestsDropped:
    """The DHT process's end of its request pipe. A request carries its reply pipe as a descriptor that the sending
    process hands over when the request is read; one whose sender has left meanwhile reads as a no-op request."""

    def __init__(self, pipe) -> None:
        self._pipe = pipe

    def recv(self):
        try:
            return self._pipe.recv()
        except (FileNotFoundError, ConnectionRefusedError):  # the sender's descriptor server is gone with it
            return "_drop_stale_request", [], {}

    def __getattr__(self, name: str):
        return getattr(self._pipe, name)


class SwarmDHT(hivemind.DHT):
    """hivemind's DHT that drops a request whose sender left before it was read (pitfall 14), and whose node reuses
    a store's lookup (``dht_lookups``, pitfall 25)."""

    def run(self) -> None:  # in the DHT's own process
        import hivemind.dht.dht

        from .dht_lookups import RemembersNearest

        self._inner_pipe = _StaleRequestsDropped(self._inner_pipe)
        hivemind.dht.dht.DHTNode = RemembersNearest  # the node hivemind's run creates, in this process only
        super().run()

    async def _drop_stale_request(self) -> None:
        pass  # nobody waits for its answer


def create_dht(initial_peers: Sequence[str], listen: str, client_mode: bool, identity_path: Optional[str] = None,
               authorizer=None, unreachable: bool = False):
    """Start this process's DHT node (a child process plus its p2pd daemon) and wait until it is up.

    :param authorizer: checks every DHT request and response (``admission.RunAuthorizer``); None admits all
    :param unreachable: the portal's dial-back found this machine unreachable (see ``relay_options``)
    """
    gc.freeze()  # pitfall 13
    return SwarmDHT(
        initial_peers=list(initial_peers),
        host_maddrs=[listen],
        client_mode=client_mode,
        identity_path=identity_path,
        authorizer=authorizer,
        # the key is new in every process (identity.PeerIdentity), so hivemind's check that no peer uses it, a second
        # p2pd that dials our own PeerID, would cost every start a quarter second (more on busy cores) for nothing
        check_if_identity_free=False,
        start=True,
        **relay_options(client_mode, initial_peers, unreachable),
    )


def relay_options(client_mode: bool, initial_peers: Sequence[str], unreachable: bool = False) -> dict:
    """hivemind's relay arguments for this peer's DHT (docs/hivemind.md#relays).

    Every peer runs p2pd with circuit relay on (``use_relay``, also hivemind's default): it can dial through relays,
    and a full peer offers relay service to peers behind NAT. A client-mode peer also looks for relays to receive
    through (``use_auto_relay``), the run's bootstrap peers first (``trusted_relays``); one the portal found
    unreachable says so (``force_reachability="private"``), since libp2p reserves relay slots only for a node it
    believes private, and AutoNAT in a small swarm may never decide.
    """
    if not client_mode:
        return dict(use_relay=True)
    options = dict(use_relay=True, use_auto_relay=True)
    relays = [addr for addr in initial_peers if _names_a_peer(addr)]
    if relays:
        options["trusted_relays"] = relays
    if unreachable:
        options["force_reachability"] = "private"
    return options


def _names_a_peer(addr: str) -> bool:
    """A multiaddr p2pd accepts as a relay: parses, ends in /p2p/<id>, is no relayed address itself (p2pd exits
    on one it cannot parse)."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        return bool(Multiaddr(addr).value_for_protocol("p2p")) and "/p2p-circuit" not in addr
    except Exception:
        return False


def relay_addresses(dht) -> List[str]:
    """This node's relayed addresses (``.../p2p-circuit``): where it receives through a relay. libp2p lists one
    once a relay with a public address has granted it a slot. Asked of p2pd each time: hivemind's
    ``get_visible_maddrs`` otherwise answers what the daemon listed at start, before any relay."""
    return [str(addr) for addr in dht.get_visible_maddrs(latest=True) if "/p2p-circuit" in str(addr)]


RELAY_WAIT = 300.0  # seconds: libp2p's autorelay reserves a slot after 3 minutes when it knows fewer than 4 relays
RELAY_POLL = 10.0  # seconds between two looks at this node's addresses


class RelayWatch(threading.Thread):
    """Tells a client-mode peer's user when it receives through a relay (a relay granted it a slot and it lists a
    relayed address), and when it stops; once, if no relay granted it a slot within ``wait`` seconds
    (docs/hivemind.md#relays).

    :param addresses: () -> this node's relayed addresses (``relay_addresses`` of its DHT)
    :param say: prints one line
    """

    def __init__(self, addresses: Callable[[], List[str]], say: Callable[[str], None], wait: float = RELAY_WAIT,
                 interval: float = RELAY_POLL):
        super().__init__(name="dedloc-relay-watch", daemon=True)
        self.addresses, self.say, self.wait, self.interval = addresses, say, wait, interval
        self.relayed: List[str] = []  # the relayed addresses seen last
        self.halted = threading.Event()

    def run(self) -> None:
        began, told_none = time.monotonic(), False
        while not self.halted.wait(self.interval):
            try:
                relayed = sorted(self.addresses())
            except Exception:  # the DHT busy or shutting down: look again next time
                continue
            if relayed and relayed != self.relayed:
                self.say(f"relay: receiving through {relayed[0]}: libp2p can reach this machine through the "
                         "relay; in client mode it still only sends (docs/hivemind.md#relays)")
            elif self.relayed and not relayed:
                self.say("relay: the relay dropped this machine's slot; libp2p looks for another")
            elif not relayed and not told_none and time.monotonic() - began > self.wait:
                self.say(f"relay: no relay granted this machine a slot in {self.wait / 60:.0f} minutes (a relay "
                         "needs a public address); it receives nothing, which client mode does not need")
                told_none = True
            self.relayed = relayed

    def halt(self, timeout: float = 10.0) -> None:
        self.halted.set()
        self.join(timeout=timeout)


REACH_TIMEOUT = 10.0  # seconds one dial and ping of ``reach_peers`` may take


async def reach_peers(_dht, node, addrs: Sequence[str], timeout: float = REACH_TIMEOUT) -> int:
    """Run in the DHT process (``dht.run_coroutine``): connect to and ping each multiaddr (with /p2p/ID), all at
    once and each within ``timeout`` seconds; how many answered. Both sides then hold each other in their routing
    tables, which a peer that was away for a while (a restarted coordinator) no longer is; a client-mode peer whose
    link was down holds nobody, for every call that failed meanwhile dropped its callee from the table."""
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    async def reach(addr: str) -> bool:
        try:
            maddr = Multiaddr(addr)
            peer_id = PeerID.from_base58(maddr.value_for_protocol("p2p"))
            # p2pd cannot decode the /p2p/ part as hivemind's Multiaddr encodes it ("length greater than remaining
            # number of bytes in buffer"): dial the transport address, the peer named apart.
            transport = maddr.decapsulate(Multiaddr(f"/p2p/{peer_id}"))
            # hivemind has no public call for this
            await asyncio.wait_for(node.p2p._client.connect(peer_id, [transport]), timeout)
            return await asyncio.wait_for(node.protocol.call_ping(peer_id), timeout) is not None
        except Exception:  # an address gone stale, or the network still down: another may answer
            return False

    reached = sum(await asyncio.gather(*(reach(addr) for addr in addrs)))
    if reached:
        # The network is back: forget who failed to answer during the outage. hivemind skips a peer that failed
        # for ever longer (5 s, doubled per failure), so after half a minute offline it would skip them for minutes.
        node.blacklist.clear()
    return reached


async def rejoin(_dht, node, addrs: Sequence[str], always: bool = False, timeout: float = REACH_TIMEOUT):
    """Run in the DHT process: (whether this node knew no peer, how many of ``addrs`` answered). It dials
    ``addrs`` (``reach_peers``) when it knows no peer, or ``always``; a node that knows peers and is not told
    ``always`` dials nobody."""
    alone = not node.protocol.routing_table.uid_to_peer_id
    if not (alone or always):
        return False, 0
    return alone, await reach_peers(_dht, node, addrs, timeout)


# Seconds a leaving peer serves the round it just finished (``trainer.train``) or one its group formed for as it left
# (hivemind's Optimizer.shutdown would wait an averaging timeout): partners receive its parts, and Ctrl-C stays quick
LEAVE_GRACE = 2.0


@dataclass
class FinishedEpoch:
    """One collaboration step this peer took part in: the epoch it closed and the samples it averaged in."""

    epoch: int
    samples: int


@dataclass
class RoundReceipts:
    """What the receipt log held once an epoch's round had ended (``receipts.ReceiptLog.drain``): the round this
    peer joined ("" if none formed), the parts it aggregated and what it cut from their senders."""

    group: str = ""
    aggregated: dict = field(default_factory=dict)
    attested: dict = field(default_factory=dict)


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

    def _make_progress_tracker(self, target_batch_size: int, **kwargs):
        from .tracker import ThrottledProgressTracker

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

    def _take_receipts(self) -> None:
        group, aggregated = self.receipts.drain() if self.receipts is not None else (None, {})
        attested = self.receipts.take_attested() if self.receipts is not None else {}
        self.rounds_over.append(RoundReceipts(group or "", aggregated, attested))
        self._round_running = False

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


def inner_optimizer(options):
    """The run's optimizer as hivemind wants it: a factory of params (the checkpointer builds the same one)."""
    import torch

    if options.name == "lamb":
        from pytorch_optimizer import Lamb

        return functools.partial(Lamb, lr=options.lr, weight_decay=options.weight_decay)
    if options.name == "adam":
        return functools.partial(torch.optim.Adam, lr=options.lr, weight_decay=options.weight_decay)
    return functools.partial(torch.optim.AdamW, lr=options.lr, weight_decay=options.weight_decay)


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
                     receipts=None, leave: Optional[threading.Event] = None):
    """The run's collaborative optimizer over ``params``, configured from the run config.

    :param aux: an auxiliary peer: it aggregates its share of every round and trains nothing
    :param receipts: the ``receipts.ReceiptLog`` its rounds are noted in (``AccountedOptimizer.rounds_over``)
    :param leave: set when the peer is asked to leave: a round it waits for gets ``LEAVE_GRACE`` more
    """
    from .averaging import PlannedGradientAverager, guard_weightless_parts
    from .matchmaking import pace_matchmaking
    from .state_sharing import declare_state_on_change

    guard_weightless_parts()
    pace_matchmaking()
    declare_state_on_change()
    gc.freeze()  # pitfall 13: the model and the loaded libraries, before the averagers fork

    opt = config.optimizer
    delay = not aux  # pitfall 16: an auxiliary peer takes no step, so it has no update to delay
    # hivemind warns (and can deadlock) when a request may outlive matchmaking; both averagers get this.
    # target_group_size: a leader starts its round once the group holds this many peers, so a larger swarm averages
    # in groups of at most this many (docs/averaging.md#groups).
    averager_opts = dict(request_timeout=opt.matchmaking_time / 2, target_group_size=opt.group_size)
    on_interrupt = signal.getsignal(signal.SIGINT)
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
                                                robust=robust_rule(config), **averager_opts,
                                                attest=receipts.note_attestation if receipts is not None else None),
        averager_opts=averager_opts,
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
    """The run's ``robust.RobustRule``, or None where it averages with the plain mean. The cap's grace is one
    matchmaking time: the most a sender's epoch can have begun before the aggregator's."""
    from .robust import RobustRule

    opt = config.optimizer
    if opt.aggregation == "mean":
        return None
    return RobustRule(tau=opt.clip_radius, iterations=opt.clip_iterations,
                      ceiling=config.samples_per_second_ceiling, grace=opt.matchmaking_time)


def restore(optimizer, state: dict) -> None:
    """Put a checkpoint's training state (``checkpoints.read_state``) into a fresh optimizer, as hivemind's own
    ``TrainingStateAverager.load_state_from_peers`` does after a download
    (docs/hivemind.md#state-checkpoints-and-resume)."""
    import torch

    averager = optimizer.state_averager
    params = [p for group in averager.optimizer.param_groups for p in group["params"]]
    if len(params) != len(state["parameters"]):
        from .errors import ConfigError

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
