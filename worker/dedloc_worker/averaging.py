"""Averaging with the planner's split of the vector instead of hivemind's own bandwidth-based split.

hivemind 1.1.12 splits the averaged vector by an LP over one announced bandwidth per peer; the coordinator's
planner chooses better shares, and ``PlannedAverager.set_plan`` applies them. Each peer announces its share with
its matchmaking metadata (``PLAN_MARKER``), so every member computes the same split (``planned_fractions``), and
planned groups run ``StreamingAllReduceRunner`` (no hold-back, a window of parts in flight).

Design, trust and the hivemind internals relied on (pinned by ``tests/test_averaging_plan.py``): docs/averaging.md.
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.optim.grad_averager import GradientAverager
from hivemind.utils import MPFuture, get_dht_time, get_logger
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, anext, as_aiter, azip, enter_asynchronously

from .leaving import ClosesReplica, EndsRunningRounds
from .robust import RobustPartReducer, RobustRule, notable_attestations
from .state_sharing import DeclaresOnChange

logger = get_logger(__name__)

PLAN_MARKER = "dedloc.plan/2"
"""First item of the metadata a ``PlannedAverager`` announces; peers without it are not ``PlannedAverager``s.
Version 2: in a planned group, results stream to zero-share peers while they upload (``StreamingAllReduceRunner``);
a version 1 peer counts as foreign, so a mixed group runs hivemind's split and hold-back unchanged."""


def planned_fractions(
    total_size: int,
    bandwidths: Sequence[Optional[float]],
    modes: Sequence[AveragingMode],
    shares: Sequence[Optional[float]],
    min_vector_size: int = 0,
) -> Tuple[float, ...]:
    """The fraction of the vector each group member aggregates, from what the members announced.

    :param total_size: elements in the averaged vector
    :param bandwidths: each member's announced bandwidth (Mbit/s in hivemind's examples; None: not given), used
      only for members without a share
    :param modes: each member's averaging mode; client-mode members always get zero
    :param shares: each member's announced share (a fraction of the vector), None where it has no plan
    :param min_vector_size: hivemind's least part size, elements, applied to hivemind's own split only
    :returns: fractions aligned with the group's peer order, summing to one
    """
    aggregates = [mode != AveragingMode.CLIENT for mode in modes]
    planned = [share is not None and can for share, can in zip(shares, aggregates)]
    planned_total = sum(float(share) for share, is_planned in zip(shares, planned) if is_planned)
    if planned_total <= 0:
        return _hivemind_fractions(total_size, bandwidths, modes, min_vector_size)
    if all(planned[i] or not aggregates[i] for i in range(len(modes))):
        unplanned = [0.0] * len(modes)  # no LP to solve: everyone who may aggregate has a share
    else:
        unplanned = _hivemind_fractions(total_size, bandwidths, modes, min_vector_size)
    left = 1.0 - sum(fraction for fraction, is_planned in zip(unplanned, planned) if not is_planned)
    return tuple(
        left * float(share) / planned_total if is_planned else fraction
        for share, is_planned, fraction in zip(shares, planned, unplanned)
    )


def _hivemind_fractions(
    total_size: int, bandwidths: Sequence[Optional[float]], modes: Sequence[AveragingMode], min_vector_size: int
) -> Tuple[float, ...]:
    """hivemind 1.1.12's own split (``DecentralizedAverager._aggregate_with_group``), as fractions."""
    announced = [b if mode != AveragingMode.CLIENT else 0.0 for b, mode in zip(bandwidths, modes)]
    elements = load_balance_peers(total_size, announced, min_vector_size)
    return tuple(count / total_size for count in elements)


@dataclass
class Transfers:
    """Payload bytes one all-reduce moved over the network, counted by this peer: the serialized tensor parts it
    sent (its vector's parts to the other aggregators and, as an aggregator, the averaged results back to each
    sender) and received (the averaged results of its parts and, as an aggregator, the senders' parts). Its own
    share never crosses the network and is not counted, nor are protobuf framing, the muxer and TLS. Compressed
    parts count as sent (fp16: 2 bytes per value)."""

    sent: int = 0
    received: int = 0


@dataclass
class RoundOutcome:
    """What this peer saw of its last all-reduce (the averaging after matchmaking).

    :param peer_ids: the group's members (base58 PeerIDs), in hivemind's order
    :param fractions: the fraction of the vector each member was to aggregate, same order
    :param planned: whether any member announced a share (else hivemind's own split ran)
    :param total_elements: elements in the averaged vector
    :param aggregated_elements: elements this peer aggregated for the group
    :param began: wall-clock time (unix seconds) this peer started its all-reduce, after matchmaking
    :param ended: wall-clock time (unix seconds) it finished or failed
    :param failed_elements: elements whose average did not come back (hivemind then keeps the local values and
      warns "received X% results"); 0 in a complete round
    :param missing_inputs: parts this peer, as an aggregator, never received from a sender; 0 in a complete round
    :param error: why the all-reduce failed, or None
    :param streamed: whether results went back to zero-share peers while they uploaded (no hold-back)
    :param most_in_flight: the most parts this peer sent an aggregator ahead of their results (streamed rounds
      only; None where hivemind's runner ran)
    :param weight_cap: the most weight (samples) this aggregator let a sender carry; None without robust rule
    :param attested: PeerID -> what this aggregator cut from that sender (``robust.Attestation.as_record``)
    :param transfers: the payload bytes the round moved over the network, as this peer counted them (read when
      the outcome is asked for: an aggregator may still be streaming results to a slower member)
    """

    peer_ids: List[str]
    fractions: List[float]
    planned: bool
    total_elements: int
    aggregated_elements: int = 0
    began: float = 0.0
    ended: float = 0.0
    failed_elements: int = 0
    missing_inputs: int = 0
    error: Optional[str] = None
    streamed: bool = False
    most_in_flight: Optional[int] = None
    weight_cap: Optional[float] = None
    attested: Dict[str, dict] = field(default_factory=dict)
    transfers: Transfers = field(default_factory=Transfers)

    @property
    def seconds(self) -> float:
        """Duration of this peer's all-reduce, seconds."""
        return self.ended - self.began

    @property
    def complete(self) -> bool:
        """Whether every part was aggregated and returned."""
        return self.error is None and self.failed_elements == 0 and self.missing_inputs == 0


async def _count_received(stream: AsyncIterator[Any], transfers: Transfers) -> AsyncIterator[Any]:
    async for message in stream:
        transfers.received += len(message.tensor_part.buffer)
        yield message


class _CountingStub:
    """A peer's averager stub whose ``rpc_aggregate_part`` answers count into ``transfers``."""

    def __init__(self, stub: Any, transfers: Transfers) -> None:
        self._stub, self._transfers = stub, transfers

    async def rpc_aggregate_part(self, inputs: AsyncIterator[Any], timeout: Optional[float] = None):
        stream = await (self._stub.rpc_aggregate_part(inputs) if timeout is None
                        else self._stub.rpc_aggregate_part(inputs, timeout=timeout))
        return _count_received(stream, self._transfers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)


class CountingAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce, unchanged, that counts the payload bytes it sends and receives (``Transfers``): what
    the round achieved over this peer's links, which its link report carries to the planner.

    :param transfers: where to count (``RoundOutcome.transfers``); a fresh one if not given
    """

    def __init__(self, *args: Any, transfers: Optional[Transfers] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.transfers = transfers if transfers is not None else Transfers()

    def _get_peer_stub(self, peer):
        # as a sender: the averaged results each aggregator streams back
        return _CountingStub(super()._get_peer_stub(peer), self.transfers)

    async def _generate_input_for_peer(self, peer_index: int):
        # as a sender: this peer's parts, as each is handed to the stream
        async for message in super()._generate_input_for_peer(peer_index):
            self.transfers.sent += len(message.tensor_part.buffer)
            yield message

    async def rpc_aggregate_part(self, stream, context):
        # as an aggregator: a sender's parts in, the averaged results out
        async for message in super().rpc_aggregate_part(_count_received(stream, self.transfers), context):
            self.transfers.sent += len(message.tensor_part.buffer)
            yield message


IN_FLIGHT_PARTS = 4
"""Parts a peer sends an aggregator ahead of the averaged results that came back from it: 1 would serialize upload
and download, unlimited starves the download (docs/benchmarks.md#window-of-parts-in-flight)."""
GROUP_POLL = 0.05
"""Seconds between two looks for a group a sender's part names and this peer has not registered yet."""


class StreamingAllReduceRunner(CountingAllReduceRunner):
    """hivemind's all-reduce without the hold-back, and with a window: averaged parts go back to every peer as
    they are ready, and a peer sends an aggregator at most ``IN_FLIGHT_PARTS`` parts ahead of their results.

    Both ends of a stream consult ``should_delay_results``, so only planned groups (every member announced
    ``PLAN_MARKER``) use this runner. The window is safe only without hold-back, and each sender decides it alone.
    Why: docs/averaging.md#hold-back and docs/averaging.md#window.

    :ivar most_in_flight: the most parts this peer had sent one aggregator without its results back
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._windows: Dict[int, asyncio.Semaphore] = {}
        self._in_flight: Dict[int, int] = {}
        self.most_in_flight = 0
        container = self.tensor_part_container
        register = container.register_processed_part

        def register_and_open(peer_index: int, part_index: int, part: Any) -> None:
            register(peer_index, part_index, part)
            if peer_index in self._windows:  # results of the local share come back without a window
                self._in_flight[peer_index] -= 1
                self._windows[peer_index].release()

        container.register_processed_part = register_and_open

    def should_delay_results(self, peer_id) -> bool:
        return False

    async def _generate_input_for_peer(self, peer_index: int):
        window = self._windows[peer_index] = asyncio.Semaphore(IN_FLIGHT_PARTS)
        self._in_flight[peer_index] = 0
        async for message in super()._generate_input_for_peer(peer_index):
            await window.acquire()
            self._in_flight[peer_index] += 1
            self.most_in_flight = max(self.most_in_flight, self._in_flight[peer_index])
            yield message
        # End the stream only once every result is in: the aggregator's close can reset the stream before its
        # last result is read (docs/averaging.md#drain).
        for _ in range(IN_FLIGHT_PARTS):
            await window.acquire()


class PlannedAverager(ClosesReplica, EndsRunningRounds, DeclaresOnChange, DecentralizedAverager):
    """``DecentralizedAverager`` that aggregates the share of the vector a plan gives it (see the module doc).

    Without a plan it behaves exactly as hivemind's averager. Same arguments as ``DecentralizedAverager``, and:

    :param robust: aggregate own parts with this rule (weight cap, non-finite parts dropped, CenteredClip) instead
      of hivemind's weighted mean; None: the plain mean
    :param attest: called in the averager's process after each round this peer aggregated in under ``robust``,
      with (group id, {PeerID: ``robust.Attestation.as_record()``}) for every sender it cut (not called when none)
    """

    def __init__(self, *args: Any, robust: Optional[RobustRule] = None,
                 attest: Optional[Callable[[bytes, Dict[str, dict]], None]] = None, **kwargs: Any) -> None:
        self._plan: Optional[Dict[str, float]] = None
        self._last_round: Optional[RoundOutcome] = None  # written in the averager's own process
        self._robust, self._attest = robust, attest
        # The weight cap's clock: senders accumulate samples from then on. None before this peer's first round: a
        # peer that joins mid-epoch has not seen how long the others have been accumulating, so it caps nothing.
        self._previous_ended: Optional[float] = None
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        # The averager's own process, forked: exempt what it inherited from the collector (pitfall 13)
        gc.freeze()
        super().run()

    async def _frozen_objects(self, future: MPFuture) -> None:
        future.set_result(gc.get_freeze_count())

    def frozen_objects(self, timeout: Optional[float] = None) -> int:
        """Objects of the averager's process that the garbage collector skips (``gc.freeze``, pitfall 13)."""
        future = MPFuture()
        self._outer_pipe.send(("_frozen_objects", [], dict(future=future)))
        return future.result(timeout)

    @property
    def plan(self) -> Optional[Dict[str, float]]:
        """The shares set last (fraction of the vector by base58 PeerID), or None."""
        return None if self._plan is None else dict(self._plan)

    def set_plan(self, shares: Optional[Mapping[str, float]]) -> None:
        """Use ``shares`` from the next ``step`` on; None returns to hivemind's own split.

        :param shares: fraction of the vector each peer aggregates, by base58 PeerID; shares need not sum to one
          (peers absent from the group are simply left out); a peer the plan does not name uses hivemind's split
        """
        if shares is not None:
            for peer, share in shares.items():
                if not (isinstance(share, (int, float)) and math.isfinite(share) and share >= 0):
                    raise ValueError(f"plan share of {peer} must be a finite fraction >= 0, got {share!r}")
            shares = {str(peer): float(share) for peer, share in shares.items()}
        self._plan = shares

    def step(self, gather: Any = None, *args: Any, **kwargs: Any):
        """``DecentralizedAverager.step``, announcing this peer's planned share along with ``gather``."""
        own = None if self._plan is None else self._plan.get(str(self.peer_id))
        return super().step([PLAN_MARKER, own, gather], *args, **kwargs)

    def last_round(self, timeout: Optional[float] = None) -> Optional[RoundOutcome]:
        """The outcome of this peer's last all-reduce, or None before the first; waits up to ``timeout`` seconds."""
        future = MPFuture()
        self._outer_pipe.send(("_get_last_round", [], dict(future=future)))
        return future.result(timeout)

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind 1.1.12's handler, waiting for this group's runner through ``asyncio.shield``. Awaited bare, the
        runner's future is shared by every sender's handler, and a sender that drops its stream before this peer
        starts the round cancels the handler and with it the future: the round then failed here with
        ``InvalidStateError`` (seen in tests/test_reachability_netns.py, as a link came back). Its annotations are
        what hivemind's ``ServicerBase`` reads the message types from."""
        request = await anext(stream)
        await self._wait_for_group(request.group_id)
        future = self._running_groups.get(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        group = await asyncio.shield(future)
        async for message in group.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _wait_for_group(self, group_id: bytes) -> None:
        """Until ``group_id`` is registered here, at most a sender's timeout (``next_chunk_timeout``; a sender waits
        twice that for its first result). A sender can get here first: the leader's reply to this peer is on its way,
        or this peer has its group and waits for its trigger, which with delayed updates comes only once its previous
        round and step are done. Turned away then, the sender's parts are lost and this peer waits out the sender
        timeout, late again for the next round: a chain of partial rounds
        (docs/benchmarks.md#delayed-parameter-updates). hivemind waits for any next group instead, so a part for a
        group that never comes held its handler until this peer's next round (tens of seconds while it is alone)."""
        kwargs = self.matchmaking_kwargs
        patience = max(kwargs["min_matchmaking_time"] + kwargs["request_timeout"], self.next_chunk_timeout or 0.0)
        deadline = time.monotonic() + patience
        while group_id not in self._running_groups and time.monotonic() < deadline:
            await asyncio.sleep(GROUP_POLL)

    async def _get_last_round(self, future: MPFuture) -> None:
        future.set_result(self._last_round)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Dict:
        """hivemind's ``_aggregate_with_group`` with ``planned_fractions`` in place of ``load_balance_peers``."""
        try:
            bandwidths, mode_ids, user_gathered_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            modes = tuple(map(AveragingMode, mode_ids))
            shares, user_gathered = _unwrap_announcements([self.serializer.loads(b) for b in user_gathered_bytes])
            fractions = await asyncio.get_event_loop().run_in_executor(
                None, planned_fractions, self.total_size, bandwidths, modes, shares, min_vector_size
            )
            outcome = RoundOutcome(
                peer_ids=[str(peer) for peer in group_info.peer_ids],
                fractions=list(fractions),
                planned=any(share is not None for share in shares),
                total_elements=self.total_size,
            )
            self._last_round = outcome
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                outcome.began = time.time()
                if self._robust is not None:
                    outcome.weight_cap = (math.inf if self._previous_ended is None else
                                          self._robust.weight_cap(outcome.began - self._previous_ended))
                try:
                    runner_type = StreamingAllReduceRunner if outcome.planned else CountingAllReduceRunner
                    await self._run_allreduce_inplace_(local_tensors, group_info, peer_fractions=fractions,
                                                       runner_type=runner_type, transfers=outcome.transfers,
                                                       **kwargs)
                except BaseException as e:
                    outcome.error = repr(e)
                    raise
                finally:
                    outcome.ended = self._previous_ended = time.time()
                    self._note_runner(outcome, group_info)
            return dict(zip(group_info.peer_ids, user_gathered))
        except BaseException as e:
            from .terminal import peer_failure

            if isinstance(e, Exception) and not peer_failure(e):  # a fault here: its traceback is wanted
                logger.exception(e)
            raise MatchmakingException(f"Unable to run All-Reduce: {e}")  # hivemind logs it (terminal.BROKE_OFF)

    async def _run_allreduce_inplace_(
        self, tensors, group_info: GroupInfo, group_id: Optional[bytes] = None,
        runner_type: type = CountingAllReduceRunner, **kwargs: Any
    ) -> None:
        """hivemind's ``_run_allreduce_inplace_`` with the runner's class as a parameter (the rest as in 1.1.12)."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = runner_type(
            p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, **kwargs,
        )
        if self._robust is not None and self._last_round is not None:
            plain = runner.tensor_part_reducer  # unused: finished quietly, else it warns "received 0.0%" when freed
            plain.current_part_future.cancel()
            plain.finished.set()
            runner.tensor_part_reducer = RobustPartReducer(
                tuple(part.shape for part in runner.parts_for_local_averaging), len(runner.sender_peer_ids),
                rule=self._robust, weight_cap=self._last_round.weight_cap, total_elements=self.total_size)
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
        else:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")

    def _note_runner(self, outcome: RoundOutcome, group_info: GroupInfo) -> None:
        """Copy what the finished ``AllReduceRunner`` knows into ``outcome`` (the runner is gone after the step)."""
        future = self._running_groups.get(group_info.group_id)
        if future is None or not future.done() or future.cancelled() or future.exception() is not None:
            return
        runner = future.result()
        outcome.streamed = isinstance(runner, StreamingAllReduceRunner)
        outcome.most_in_flight = getattr(runner, "most_in_flight", None)
        outcome.aggregated_elements = sum(part.numel() for part in runner.parts_for_local_averaging)
        outcome.failed_elements = int(runner.tensor_part_container.failed_size)
        reducer = runner.tensor_part_reducer
        if reducer.num_parts and reducer.num_senders:
            outcome.missing_inputs = reducer.num_parts * reducer.num_senders - sum(reducer.num_parts_received)
        outcome.attested = notable_attestations(reducer, [str(peer) for peer in runner.sender_peer_ids])
        if outcome.attested and self._attest is not None:
            self._attest(group_info.group_id, outcome.attested)


def _unwrap_announcements(gathered: Sequence[Any]) -> Tuple[List[Optional[float]], List[Any]]:
    """Split each member's metadata into (share, the caller's own gather); all shares None if any member is foreign."""
    ours = [isinstance(item, (list, tuple)) and len(item) == 3 and item[0] == PLAN_MARKER for item in gathered]
    user = [item[2] if mine else item for item, mine in zip(gathered, ours)]
    if not all(ours):
        return [None] * len(gathered), user  # a foreign member computes hivemind's split: so must we
    shares = [item[1] if isinstance(item[1], (int, float)) and math.isfinite(item[1]) else None for item in gathered]
    return [None if share is None or share < 0 else float(share) for share in shares], user


class PlannedGradientAverager(GradientAverager, PlannedAverager):
    """hivemind's ``GradientAverager`` with ``set_plan`` (pass it as ``grad_averager_factory``).

    ``GradientAverager.schedule_step`` calls ``super().step``, which resolves to ``PlannedAverager.step`` here, so
    pre-scheduled rounds announce the share too.

    It is no source of the run's state (peers load state from the state averager alone): hivemind would have it keep
    a DHT record saying it is, renewed at every epoch for nothing.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_state_sharing", False)
        super().__init__(*args, **kwargs)

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None) -> None:
        """Nothing to load: its buffers are this epoch's gradients, reset before use. hivemind's Optimizer asks after
        every state download, and the ask found no source and said so in the terminal."""
        return None


def guard_weightless_parts() -> None:
    """Make a part whose senders all carry weight 0 average to zeros instead of 0/0 = NaN. Call before forking.

    A group of an auxiliary peer and a trainer that has just reloaded state carries weight 0, and the NaN spreads
    to the whole swarm (docs/hivemind.md#pitfalls, pitfall 6). The patched
    ``TensorPartReducer.check_current_part_finished`` is pinned by tests/test_averaging_plan.py.
    """
    from hivemind.averaging.partition import TensorPartReducer

    original = getattr(TensorPartReducer.check_current_part_finished, "__wrapped__",
                       TensorPartReducer.check_current_part_finished)

    def check_current_part_finished(self):
        if self.current_part_accumulated_from == self.num_current_senders and self.denominator == 0:
            self.denominator = 1.0  # the accumulator holds zeros: the weighted mean of nothing
        return original(self)

    check_current_part_finished.__wrapped__ = original
    TensorPartReducer.check_current_part_finished = check_current_part_finished
