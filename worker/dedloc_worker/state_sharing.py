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
state, which hivemind 1.1.12 then fails to load with a traceback, or skips while believing it loaded.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from hivemind.averaging import DecentralizedAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import get_logger

from .leaving import ClosesReplica, EndsRunningRounds, RemembersRounds

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


class ChecksDownloads(DecentralizedAverager):
    """Base for a ``TrainingStateAverager`` subclass, listed after it: a downloaded state that lacks tensors its
    metadata names is dropped with one line, as a failed download is, and the optimizer downloads again at its next
    step. (One cut inside a tensor already fails hivemind's deserialization, as a failed download.)"""

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None):
        loaded = super().load_state_from_peers(wait=wait, timeout=timeout)
        if not wait or loaded is None:
            return loaded
        metadata, tensors = loaded
        expected = expected_tensors(self, metadata)
        if expected != len(tensors):
            of = "" if expected is None else f" of {expected}"
            logger.warning(f"the training state downloaded from a peer was incomplete ({len(tensors)}{of} tensors); "
                           "downloading it again")
            return None
        return loaded


def expected_tensors(averager: TrainingStateAverager, metadata) -> Optional[int]:
    """How many tensors a state with ``metadata`` holds for ``averager``'s model and optimizer (the order of
    ``TrainingStateAverager.get_current_state``); None for metadata that is not a state's."""
    entries = metadata.get("optimizer_metadata") if isinstance(metadata, dict) else None
    if not isinstance(entries, list):
        return None
    parameters = sum(len(group["params"]) for group in averager.optimizer.param_groups)
    return parameters + len(averager.extra_tensors) + sum(
        1 for entry in entries if isinstance(entry, dict) and entry.get("type") == "tensor")


class StateAverager(ClosesReplica, EndsRunningRounds, DeclaresOnChange, TrainingStateAverager, ChecksDownloads,
                    RemembersRounds):
    """hivemind's ``TrainingStateAverager``, declaring itself as a state source on its period and on a change, and
    loading only a whole download."""

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
