"""Declaring this peer as a source of the run's state on a period and on a change, not after every tensor.

Every averager that shares its state keeps a DHT record naming it a source for peers that load state
(``<prefix>.all_averagers``, its value the peer's priority: its epoch). hivemind 1.1.12 renews the record every
``declare_state_period``, when the priority changes, and also after every tensor a round averages: the record stays
the same, yet each renewal is a signed DHT store to the peers that hold it. In a two-worker tiny-lm swarm that was
7-8 stores a second per worker, more than the rest of its DHT traffic together (docs/hivemind.md#pitfalls, 15).
"""

from __future__ import annotations

import asyncio

from hivemind.optim.state_averager import TrainingStateAverager


class _SetOnRequest(asyncio.Event):
    """The averager's "state updated" event, which wakes its declaration loop. hivemind sets it after every averaged
    tensor; that no longer wakes the loop, and ``_trigger_declare_load_state`` (a priority change) still does."""

    def set(self) -> None:
        pass


class DeclaresOnChange:
    """Mixin for a ``DecentralizedAverager`` subclass, listed before it: the declaration loop wakes on its period and
    on a priority change only."""

    async def _declare_for_download_periodically(self) -> None:
        # hivemind creates the event right after scheduling this loop, before the loop starts
        self._state_updated = _SetOnRequest()
        await super()._declare_for_download_periodically()

    async def _trigger_declare_load_state(self) -> None:
        asyncio.Event.set(self._state_updated)


class StateAverager(DeclaresOnChange, TrainingStateAverager):
    """hivemind's ``TrainingStateAverager``, declaring itself as a state source on its period and on a change."""

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
