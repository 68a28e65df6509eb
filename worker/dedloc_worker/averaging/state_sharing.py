"""Declaring this peer as a source of the run's state on a period and on a change, not after every tensor.

Every averager that shares its state keeps a DHT record naming it a source for peers that load state
(``<prefix>.all_averagers``, its value the peer's priority: its epoch). hivemind 1.1.12 renews the record every
``declare_state_period``, when the priority changes, and also after every tensor a round averages: the record stays
the same, yet each renewal is a signed DHT store to the peers that hold it. In a two-worker tiny-lm swarm that was
7-8 stores a second per worker, more than the rest of its DHT traffic together (docs/hivemind.md#pitfalls, 15).
The priority itself changes at every epoch (seconds apart in a fast swarm); a loader only needs it roughly current,
so renewals for it are spaced by ``PRIORITY_SPACING`` at least.

A download of the state is checked before it is loaded (``ChecksDownloads``): hivemind's download stream has no end
marker, and one cut short at a tensor boundary (4 in 1,973 downloads from a busy peer) reads as a shorter
state, which hivemind 1.1.12 then fails to load with a traceback, or skips while believing it loaded. A state that
is not finite, or whose parameters lie farther from this peer's own than the steps between them can move them
(``state_refusal``), is refused with one line, and the next source is tried.

State rounds average parameters with the run's robust rule (``ClipsStateRounds``, docs/averaging.md#state-rounds):
hivemind's plain weighted mean let one peer that sent x1000 or NaN parameters poison every peer of its group.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Set

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_logger
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

from dedloc_worker.averaging.allreduce import average_in_place
from dedloc_worker.averaging.robust import RobustRule, StatePartReducer, notable_attestations, replace_reducer
from dedloc_worker.swarm.leaving import ClosesReplica, EndsRunningRounds, RemembersRounds

logger = get_logger(__name__)

# Seconds between two renewals of the record for a priority change, at least: a loader picks the highest priority,
# and every source's epoch is then at most this stale (the record's value, not the state it serves).
PRIORITY_SPACING = 10.0


class _SetOnRequest(asyncio.Event):
    """The averager's "state updated" event, which wakes its declaration loop. hivemind sets it after every averaged
    tensor; that no longer wakes the loop. ``request`` (a priority change) does, ``spacing`` seconds after the last
    renewal at the earliest; requests meanwhile make one renewal."""

    def __init__(self, spacing: float):
        super().__init__()
        self.spacing, self.renewed = spacing, float("-inf")
        self.later: Optional[asyncio.TimerHandle] = None

    def set(self) -> None:
        pass

    def clear(self) -> None:  # the loop clears the event right after each renewal
        self.renewed = time.monotonic()
        if self.later is not None:
            self.later.cancel()
            self.later = None
        super().clear()

    def request(self) -> None:
        wait = self.renewed + self.spacing - time.monotonic()
        if wait <= 0:
            asyncio.Event.set(self)
        elif self.later is None:
            self.later = asyncio.get_running_loop().call_later(wait, asyncio.Event.set, self)


class DeclaresOnChange:
    """Mixin for a ``DecentralizedAverager`` subclass, listed before it: the declaration loop wakes on its period and
    on a priority change only, at most once per ``priority_spacing`` seconds for the latter."""

    priority_spacing = PRIORITY_SPACING

    async def _declare_for_download_periodically(self) -> None:
        # hivemind creates the event right after scheduling this loop, before the loop starts
        self._state_updated = _SetOnRequest(self.priority_spacing)
        await super()._declare_for_download_periodically()

    async def _trigger_declare_load_state(self) -> None:
        event = self._state_updated  # hivemind's own until the loop starts (never, in client mode)
        event.request() if isinstance(event, _SetOnRequest) else event.set()


# How far one optimizer step can move a parameter, in its optimizer's learning rates (per element, root mean square):
# Adam's step is at most (1 - beta1) / sqrt(1 - beta2) = 3.2 learning rates in an element, LAMB's a layer's norm
# times the rate (``state_refusal`` scales by the parameters' own size where it exceeds 1).
STEP_REACH = 4.0
# Sources a peer tries before it gives up a download (hivemind then asks again at the optimizer's next step).
SOURCES_TRIED = 3


class ChecksDownloads(DecentralizedAverager):
    """Base for a ``TrainingStateAverager`` subclass, listed after it: a downloaded state is loaded only if it is
    whole (a state that lacks tensors its metadata names, as a failed download is), finite, and near this peer's
    own parameters (``state_refusal``). A refused state is named in one line and the next source, by priority, is
    tried, ``SOURCES_TRIED`` at most; the optimizer downloads again at its next step. (One cut inside a tensor
    already fails hivemind's deserialization, as a failed download.)"""

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None):
        if not wait:
            return super().load_state_from_peers(wait=wait, timeout=timeout)
        refused: Set[str] = set()
        for _ in range(SOURCES_TRIED):
            future = MPFuture()
            self._outer_pipe.send(("_download_state", [], dict(timeout=timeout, future=future, skip=refused)))
            downloaded = future.result(timeout=timeout)
            if downloaded is None:
                return None
            source, metadata, tensors = downloaded
            reason = state_refusal(self, metadata, tensors)
            if reason is None:
                return metadata, tensors
            refused.add(source)
            logger.warning(f"refused the training state of peer {source}: {reason}; trying another peer")
        return None

    async def _download_state(self, future: MPFuture, timeout: Optional[float] = None, skip: Iterable[str] = ()):
        """In the averager's process: hivemind 1.1.12's ``_load_state_from_peers``, passing over the peers in
        ``skip`` (base58) and naming the source: (its PeerID, metadata, tensors), or None."""
        if timeout is not None:
            timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        try:
            key_manager = self._matchmaking.group_key_manager
            peer_priority, _ = self.dht.get(f"{key_manager.prefix}.all_averagers", latest=True) or ({}, None)
            if not isinstance(peer_priority, dict):
                peer_priority = {}
            peer_priority = {
                PeerID(peer_id): (float(info.value), random.random())  # randomness breaks ties, as hivemind's
                for peer_id, info in peer_priority.items()
                if isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int))
            }
            for peer in sorted(peer_priority, key=peer_priority.get, reverse=True):
                if peer == self.peer_id or str(peer) in set(skip):
                    continue
                try:
                    metadata, tensors = await self._download_from(peer, timeout)
                except Exception as e:
                    logger.warning(f"could not download the training state from peer {peer}: {e!r}")
                    continue
                if metadata:
                    future.set_result((str(peer), metadata, tensors))
                    return
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_from(self, peer: PeerID, timeout: Optional[float]):
        """The state ``peer`` serves: (metadata or None, tensors), as hivemind 1.1.12 reads the stream."""
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        return await read_state_stream(stream, self.serializer, timeout)


async def read_state_stream(stream, serializer, timeout: Optional[float], keep=None):
    """A served state's stream as hivemind 1.1.12 reads it: (metadata or None, tensors). ``keep(metadata)`` False
    drops the stream as soon as its metadata (first in it) is read: then (None, [])."""
    metadata, parts, tensors = None, [], []
    async for message in aiter_with_timeout(stream, timeout=timeout):
        if message.metadata:
            metadata = serializer.loads(message.metadata)
            if keep is not None and not keep(metadata):
                return None, []
        if message.tensor_part.dtype and parts:  # a new tensor begins
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            parts = []
        parts.append(message.tensor_part)
    if parts:
        tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
    return metadata, tensors


def state_refusal(averager: TrainingStateAverager, metadata, tensors: Sequence[torch.Tensor]) -> Optional[str]:
    """Why a downloaded state (``metadata``, ``tensors``) must not be loaded into ``averager``, or None.

    Refused: a state that lacks tensors its metadata names; any tensor not finite; parameters whose root mean square
    distance from this peer's own (per element) exceeds ``STEP_REACH`` learning rates (the largest a group sets, as
    at the schedule's peak) per epoch between the two, one epoch more, scaled by the own parameters' root mean
    square where that exceeds 1. This peer's own are the run's initial model (every peer builds it from the run's
    seed), the checkpoint it resumed from, or what it trained, at its own epoch.
    """
    expected = expected_tensors(averager, metadata)
    if expected != len(tensors):
        of = "" if expected is None else f" of {expected}"
        return f"it was incomplete ({len(tensors)}{of} tensors)"
    bad = sum(1 for tensor in tensors if not bool(torch.isfinite(tensor).all()))
    if bad:
        return f"{bad} of its {len(tensors)} tensors are not finite"
    own = [p for group in averager.optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        squares = sum(float(((t.float() - p.detach().cpu().float()) ** 2).sum()) for t, p in zip(tensors, own))
        own_squares = sum(float((p.detach().float() ** 2).sum()) for p in own)
    elements = max(sum(p.numel() for p in own), 1)
    distance, scale = math.sqrt(squares / elements), max(1.0, math.sqrt(own_squares / elements))
    epoch = metadata.get("epoch")  # hivemind refuses a state without an integer epoch after this check
    epochs = max((epoch if isinstance(epoch, int) else 0) - int(averager.local_epoch), 0) + 1
    rate = max(float(group.get("initial_lr", group.get("lr", 0.0))) for group in averager.optimizer.param_groups)
    reach = STEP_REACH * rate * epochs * scale
    if distance > reach:
        return (f"its parameters lie {distance:.3g} (root mean square) from this peer's at epoch "
                f"{averager.local_epoch}, more than {epochs} epochs of steps reach ({reach:.3g})")
    return None


def expected_tensors(averager: TrainingStateAverager, metadata) -> Optional[int]:
    """How many tensors a state with ``metadata`` holds for ``averager``'s model and optimizer (the order of
    ``TrainingStateAverager.get_current_state``); None for metadata that is not a state's."""
    entries = metadata.get("optimizer_metadata") if isinstance(metadata, dict) else None
    if not isinstance(entries, list):
        return None
    parameters = sum(len(group["params"]) for group in averager.optimizer.param_groups)
    return parameters + len(averager.extra_tensors) + sum(
        1 for entry in entries if isinstance(entry, dict) and entry.get("type") == "tensor")


# CenteredClip's radius in state rounds, per element, in learning rates (an Adam step moves an element by about one).
# Peers that averaged the same gradients hold the same parameters, and one that stepped alone differs by a step or
# so: the median start puts the round's result with the majority whatever the radius, and the radius bounds what
# one sender of weight 1 in n moves it by, radius * sqrt(elements) / (n - 1) (docs/averaging.md#state-rounds).
STATE_RADIUS = 0.1


@dataclass(frozen=True)
class StateClip:
    """How state rounds aggregate (docs/averaging.md#state-rounds).

    :param radius: CenteredClip's radius per element, in parameter units: a part of k elements is clipped at
      ``radius * sqrt(k)``
    :param iterations: CenteredClip iterations
    """

    radius: float
    iterations: int


def state_clip(config) -> Optional[StateClip]:
    """The state rounds' rule for a run (``RunConfig``): under ``averaging.centered_clip``, a radius of ``STATE_RADIUS``
    learning rates per element; None under ``mean``."""
    options = config.optimizer
    if options.aggregation == "mean":
        return None
    return StateClip(radius=STATE_RADIUS * options.lr, iterations=options.clip_iterations)


class ClipsStateRounds:
    """Mixin for a ``DecentralizedAverager`` subclass, listed before it: with a ``StateClip`` (``state_clip``
    argument), each round's parts are aggregated by ``averaging.robust.StatePartReducer``: non-finite copies dropped,
    weights
    capped at one peer's, CenteredClip around the median. Without one, hivemind's weighted mean."""

    def __init__(self, *args: Any, state_clip: Optional[StateClip] = None, **kwargs: Any) -> None:
        self._state_clip = state_clip  # before hivemind's constructor forks the averager's process
        super().__init__(*args, **kwargs)

    async def _run_allreduce_inplace_(self, tensors, group_info: GroupInfo, group_id: Optional[bytes] = None,
                                      **kwargs: Any) -> None:
        """hivemind 1.1.12's ``_run_allreduce_inplace_``, with ``StatePartReducer`` installed before the round."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = AllReduceRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                                 group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
        clip = self._state_clip
        if clip is not None:
            replace_reducer(runner, StatePartReducer(
                tuple(part.shape for part in runner.parts_for_local_averaging), len(runner.sender_peer_ids),
                rule=RobustRule(tau=clip.radius, iterations=clip.iterations), radius=clip.radius))
        try:
            await average_in_place(self, runner, group_info, group_id, tensors)
        finally:
            if clip is not None:
                _say_cuts(runner)


def _say_cuts(runner: AllReduceRunner) -> None:
    """One line for the senders whose state this aggregator dropped (not finite) or whose weight it capped."""
    cuts = notable_attestations(runner.tensor_part_reducer, [str(peer) for peer in runner.sender_peer_ids])
    named = [f"{peer} ({note['dropped']} parts not finite)" if note["dropped"] else
             f"{peer} (weight {note['weight']:g} capped to {note['used']:g})"
             for peer, note in cuts.items() if note["dropped"] or note["used"] < note["weight"]]
    if named:
        logger.warning(f"state round: cut what {', '.join(named)} sent")


class StateAverager(ClosesReplica, EndsRunningRounds, DeclaresOnChange, ClipsStateRounds, TrainingStateAverager,
                    ChecksDownloads, RemembersRounds):
    """hivemind's ``TrainingStateAverager``, declaring itself as a state source on its period and on a change,
    averaging state robustly when given a ``StateClip``, and loading only a whole, plausible download."""

    @classmethod
    def _get_handle_name(cls, namespace, method_name: str) -> str:
        # hivemind names a peer's RPC handlers after its class: under its own name, hivemind's TrainingStateAverager
        # (the coordinator's checkpointer and spot checker) could not download this peer's state.
        return TrainingStateAverager._get_handle_name(namespace, method_name)


def declare_state_on_change() -> None:
    """Make every optimizer created from now on (in this process and its forks) average state with
    ``StateAverager``. hivemind's ``Optimizer`` builds its state averager by this module-level name (pinned by
    tests/test_state_sharing.py)."""
    import hivemind.optim.optimizer as optimizer

    optimizer.TrainingStateAverager = StateAverager
