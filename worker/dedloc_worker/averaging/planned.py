"""Averaging with the planner's split of the vector instead of hivemind's own bandwidth-based split.

hivemind 1.1.12 splits the averaged vector by an LP over one announced bandwidth per peer; the coordinator's
planner chooses better shares, and ``PlannedAverager.set_plan`` applies them. Each peer announces its share and the
signed plan it comes from with its matchmaking metadata (``averaging.announcements.PLAN_MARKER``), so every member
checks every announcement and computes the same split (``averaging.announcements.split_group``); a member whose share
does not hold up is left out of the round and reported. Planned groups run ``StreamingAllReduceRunner`` (no hold-back, a
window of parts in flight).

Design, trust and the hivemind internals relied on (pinned by ``tests/test_averaging_plan.py``): docs/averaging.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from dedloc_common import contract
from dedloc_common.contract import PlanRecord
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.optim.grad_averager import GradientAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_logger
from hivemind.utils.asyncio import achain, anext, as_aiter, enter_asynchronously

from dedloc_worker.averaging.allreduce import average_in_place
from dedloc_worker.averaging.announcements import (
    GroupSplit,
    PlanCheck,
    announce,
    split_group,
    trusted_shares,
    unwrap,
)
from dedloc_worker.averaging.robust import (
    RobustPartReducer,
    RobustRule,
    TalliedPartReducer,
    applied_weights,
    notable_attestations,
    replace_reducer,
)
from dedloc_worker.averaging.state_sharing import DeclaresOnChange
from dedloc_worker.swarm.leaving import ClosesReplica, EndsRunningRounds

logger = get_logger(__name__)

def planned_fractions(
    total_size: int,
    bandwidths: Sequence[Optional[float]],
    modes: Sequence[AveragingMode],
    shares: Sequence[Optional[float]],
    min_vector_size: int = 0,
) -> Tuple[float, ...]:
    """The fraction of the vector each group member aggregates, from the shares the members announced, unchecked:
    the split of an averager without the run's authority (``PlannedAverager``'s ``authority``).

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
    :param attested: PeerID -> what this aggregator cut from that sender or missed of its parts
      (``averaging.robust.Attestation.as_record``)
    :param transfers: the payload bytes the round moved over the network, as this peer counted them (read when
      the outcome is asked for: an aggregator may still be streaming results to a slower member)
    :param group: the round's group id (hex), as receipts name it
    :param left_out: PeerID -> why that member was left out of the round (``averaging.announcements.split_group``); this
      peer's own PeerID there: it took no part
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
    left_out: Dict[str, str] = field(default_factory=dict)
    group: str = ""

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

    Same arguments as ``DecentralizedAverager``, and:

    :param authority: the run's authority key (``admission.gate.TokenCheck.authority``), which signs plans: every
      member's announced share is checked against its signed plan, a member whose share does not hold up is left out
      of the round and attested, and a group without a plan splits equally (docs/averaging.md#checked-shares). None:
      shares are taken as announced, and a group without them runs hivemind's own split (the benches, which plan by
      hand and compare with hivemind's split; the worker always passes the authority)

    :param robust: aggregate own parts with this rule (weight cap, non-finite parts dropped, CenteredClip) instead
      of hivemind's weighted mean; None: the plain mean
    :param attest: called in the averager's process after each round this peer aggregated in, with (group id,
      {PeerID: ``averaging.robust.Attestation.as_record()``} of every sender it cut something from or missed parts of,
      {PeerID: the weight its parts carried in} of every other sender that sent it a part): the receipts
    """

    _plan_check: Optional[PlanCheck] = None  # set from ``authority``
    _plan_record: Optional[PlanRecord] = None

    def __init__(self, *args: Any, robust: Optional[RobustRule] = None, authority: Any = None,
                 attest: Optional[Callable[[bytes, Dict[str, dict], Dict[str, float]], None]] = None,
                 **kwargs: Any) -> None:
        self._plan: Optional[Dict[str, float]] = None
        self._plan_check = None if authority is None else PlanCheck(authority)
        self._last_round: Optional[RoundOutcome] = None  # written in the averager's own process
        self._last_finished: Optional[RoundOutcome] = None  # the newest round that ended there, complete or not
        self._robust, self._attest = robust, attest
        # The weight cap's clock: senders accumulate samples from then on. None before this peer's first round: a
        # peer that joins mid-epoch has not seen how long the others have been accumulating, so it caps nothing.
        self._previous_ended: Optional[float] = None
        self._previous_began = 0.0
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

    def set_plan(self, plan: Union[PlanRecord, Mapping[str, float], None]) -> None:
        """Use ``plan`` from the next ``step`` on; None: no plan.

        :param plan: the run's signed plan, whose shares are the fraction of the vector each peer aggregates by
          base58 PeerID (they need not sum to one: peers absent from a group are left aside; a peer the plan does
          not name gets an equal fraction, docs/averaging.md#checked-shares); an averager without the run's authority
          also takes the shares alone
        :raises ValueError: a share that is not a finite fraction >= 0; for an averager with the run's authority,
          shares without their signed plan, or a plan the authority did not sign (its peers would leave it out)
        """
        record = plan if isinstance(plan, PlanRecord) else None
        shares = None if plan is None else record.shares if record is not None else plan
        if shares is not None:
            for peer, share in shares.items():
                if not (isinstance(share, (int, float)) and math.isfinite(share) and share >= 0):
                    raise ValueError(f"plan share of {peer} must be a finite fraction >= 0, got {share!r}")
            shares = {str(peer): float(share) for peer, share in shares.items()}
        if self._plan_check is not None and plan is not None:
            if record is None:
                raise ValueError("this averager checks plans against the run's authority: give it the signed plan")
            if not self._plan_check.authentic(record):
                raise ValueError(f"the plan issued at {record.issued_at!r} is not signed by the run's authority")
        self._plan, self._plan_record = shares, record

    def set_ceiling(self, samples_per_second: float) -> None:
        """Cap senders' weights at ``samples_per_second`` per peer from the next round on: the run's ceiling in force,
        as the signed plan carries it (docs/averaging.md#ceiling). Nothing without a robust rule."""
        if self._robust is not None and samples_per_second != self._robust.ceiling:
            self._robust = dataclasses.replace(self._robust, ceiling=float(samples_per_second))
            self._outer_pipe.send(("_set_ceiling", [float(samples_per_second)], {}))

    async def _set_ceiling(self, samples_per_second: float) -> None:
        self._robust = dataclasses.replace(self._robust, ceiling=samples_per_second)  # the averager's own process

    @property
    def ceiling(self) -> Optional[float]:
        """The samples-per-second ceiling senders' weights are capped with (None: not capped)."""
        return None if self._robust is None else self._robust.ceiling

    def step(self, gather: Any = None, *args: Any, **kwargs: Any):
        """``DecentralizedAverager.step``, announcing this peer's planned share along with ``gather``."""
        return super().step(self._announcement(gather), *args, **kwargs)

    def _announcement(self, gather: Any) -> list:
        """What this peer announces in place of ``gather``: its share under its plan, and the plan."""
        own = None if self._plan is None else self._plan.get(str(self.peer_id))
        return announce(own, self._plan_record, gather)

    def last_round(self, timeout: Optional[float] = None) -> Optional[RoundOutcome]:
        """The outcome of this peer's last all-reduce, or None before the first; waits up to ``timeout`` seconds."""
        return self._ask("_get_last_round", timeout)

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

    def finished_round(self, timeout: Optional[float] = None) -> Optional[RoundOutcome]:
        """The outcome of this peer's newest all-reduce that has ended, or None before the first ends. With delayed
        gradient averaging the next round is often running when the training loop asks (``last_round`` is then one
        without an end), and a report built from ``last_round`` alone then missed every round's figures."""
        return self._ask("_get_finished_round", timeout)

    def _ask(self, handler: str, timeout: Optional[float]) -> Optional[RoundOutcome]:
        """What ``handler`` answers in the averager's own process, where the outcomes are written."""
        future = MPFuture()
        self._outer_pipe.send((handler, [], dict(future=future)))
        return future.result(timeout)

    async def _get_last_round(self, future: MPFuture) -> None:
        future.set_result(self._last_round)

    async def _get_finished_round(self, future: MPFuture) -> None:
        future.set_result(self._last_finished)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Dict:
        """hivemind's ``_aggregate_with_group`` with the checked split (``_split``) in place of
        ``load_balance_peers``."""
        try:
            bandwidths, mode_ids, user_gathered_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            modes = tuple(map(AveragingMode, mode_ids))
            announcements, user_gathered = unwrap([self.serializer.loads(b) for b in user_gathered_bytes])
            peer_ids = [str(peer) for peer in group_info.peer_ids]
            split = await asyncio.get_event_loop().run_in_executor(
                None, self._split, peer_ids, bandwidths, modes, announcements, min_vector_size
            )
            outcome = RoundOutcome(peer_ids=peer_ids, fractions=list(split.fractions), planned=split.planned,
                                   total_elements=self.total_size, left_out=dict(split.left_out),
                                   group=group_info.group_id.hex())
            self._last_round = outcome
            if str(self.peer_id) in outcome.left_out:  # its peers refuse its parts: nothing to run
                raise MatchmakingException(f"left out of the round: it {outcome.left_out[str(self.peer_id)]}")
            self._report_left_out(group_info.group_id, outcome.left_out)
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                outcome.began = time.time()
                if self._robust is not None:
                    outcome.weight_cap = math.inf if self._previous_ended is None else self._robust.weight_cap(
                        outcome.began - self._robust.clock_start(self._previous_began, self._previous_ended))
                try:
                    runner_type = StreamingAllReduceRunner if outcome.planned else CountingAllReduceRunner
                    await self._run_allreduce_inplace_(local_tensors, group_info, peer_fractions=split.fractions,
                                                       runner_type=runner_type, transfers=outcome.transfers,
                                                       **kwargs)
                except BaseException as e:
                    outcome.error = repr(e)
                    raise
                finally:
                    outcome.ended = self._previous_ended = time.time()
                    self._previous_began = outcome.began
                    self._note_runner(outcome, group_info)
                    self._last_finished = outcome
            return dict(zip(group_info.peer_ids, user_gathered))
        except BaseException as e:
            from dedloc_worker.terminal import peer_failure

            if isinstance(e, Exception) and not peer_failure(e):  # a fault here: its traceback is wanted
                logger.exception(e)
            # as hivemind raises it, unchained: hivemind logs it (terminal.BROKE_OFF)
            raise MatchmakingException(f"Unable to run All-Reduce: {e}")  # noqa: B904

    def _split(self, peer_ids: List[str], bandwidths: Sequence[Optional[float]], modes: Sequence[AveragingMode],
               announcements: Sequence[Any], min_vector_size: int) -> "_Split":
        """The group's split: checked against the run's authority where this averager has it, else as announced."""
        if self._plan_check is None:
            shares = trusted_shares(announcements)
            fractions = planned_fractions(self.total_size, bandwidths, modes, shares, min_vector_size)
            return _Split(fractions, any(share is not None for share in shares), {})
        checked: GroupSplit = split_group(peer_ids, modes, announcements, self._plan_check)
        return _Split(checked.fractions, checked.plan is not None, checked.left_out)

    def _report_left_out(self, group_id: bytes, left_out: Dict[str, str]) -> None:
        """Say in a line, and attest as an aggregator attests what it cut (``contract.Attestation.left_out``), each
        member left out of this round: nothing of its parts is averaged here."""
        for peer, reason in left_out.items():
            logger.warning(f"left {peer} out of averaging round {group_id.hex()[:8]}: it {reason}")
        if left_out and self._attest is not None:
            notes = {peer: contract.Attestation(parts=0, weight=0.0, used=0.0, dropped=0, clipped=0, kept=1.0,
                                                left_out=reason).dict() for peer, reason in left_out.items()}
            self._attest(group_id, notes)

    @staticmethod
    def _refuse_left_out(runner: AllReduceRunner, left_out: Mapping[str, str]) -> None:
        """Ban the senders left out of this round before it starts, as hivemind bans one that missed its timeout:
        the reducer averages the others' parts and refuses theirs, and nobody waits for them."""
        for index, peer in enumerate(runner.sender_peer_ids):
            if str(peer) in left_out:
                runner.banned_senders.add(peer)
                runner.active_senders.add(peer)  # not waited for as a missing sender (_handle_missing_senders)
                runner.tensor_part_reducer.on_sender_failed(index)
                # counted as come: hivemind's reducer would say "received 67% of input tensors" of a refused peer
                runner.tensor_part_reducer.num_parts_received[index] = runner.tensor_part_reducer.num_parts
        if len(runner.active_senders) == len(runner.sender_peer_ids):
            runner.all_senders_started.set()

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
        if self._last_round is not None:  # a reducer that tallies each sender's parts: the receipts
            shapes = tuple(part.shape for part in runner.parts_for_local_averaging)
            senders = len(runner.sender_peer_ids)
            replace_reducer(runner, TalliedPartReducer(shapes, senders) if self._robust is None else (
                RobustPartReducer(shapes, senders, rule=self._robust, weight_cap=self._last_round.weight_cap,
                                  total_elements=self.total_size)))
        if self._last_round is not None and self._last_round.left_out:
            self._refuse_left_out(runner, self._last_round.left_out)
        await average_in_place(self, runner, group_info, group_id, tensors)

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
        counted = [received for peer, received in zip(runner.sender_peer_ids, reducer.num_parts_received)
                   if str(peer) not in outcome.left_out]  # refused at the start, not missing
        if reducer.num_parts and counted:
            outcome.missing_inputs = reducer.num_parts * len(counted) - sum(counted)
        senders = [str(peer) for peer in runner.sender_peer_ids]
        outcome.attested = notable_attestations(reducer, senders)
        applied = applied_weights(reducer, senders, own=str(self.peer_id))
        if (outcome.attested or applied) and self._attest is not None:
            self._attest(group_info.group_id, outcome.attested, applied)


@dataclass
class _Split:
    fractions: Tuple[float, ...]
    planned: bool  # a plan gave the split: the group streams (StreamingAllReduceRunner)
    left_out: Dict[str, str]


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
