"""Matchmaking that reads the DHT at a bounded rate.

While a peer looks for its averaging group and no leader is queued, hivemind's ``PotentialLeaders`` reads the group
key again the moment the last read returns: measured here, a read every ~12 ms (80 a second) for as long as a peer
waits for the others, each read a set of signed DHT RPCs. In a two-worker tiny-lm swarm that was 7.5 reads a
second per worker on average, most of its DHT process's CPU (docs/benchmarks.md#where-a-swarm-spends-its-cpu). A
follower finds its leader at its first read, which stays immediate; the later reads only catch leaders that declared
after it, and ``READS_PER_WINDOW`` reads per matchmaking window catch them in time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, TypeVar

from hivemind.averaging.matchmaking import Matchmaking

READS_PER_WINDOW = 5  # reads of the group key per min_matchmaking_time, at most
T = TypeVar("T")


class Paced:
    """An async function that starts at most once every ``interval`` seconds: a call that comes sooner waits."""

    def __init__(self, function: Callable[..., Awaitable[T]], interval: float):
        self.function, self.interval, self.last = function, interval, float("-inf")

    async def __call__(self, *args, **kwargs) -> T:
        wait = self.last + self.interval - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self.last = time.monotonic()
        return await self.function(*args, **kwargs)


class PacedMatchmaking(Matchmaking):
    """hivemind's ``Matchmaking``, reading the group key at most ``READS_PER_WINDOW`` times per matchmaking time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        keys = self.group_key_manager
        keys.get_averagers = Paced(keys.get_averagers, self.min_matchmaking_time / READS_PER_WINDOW)


def pace_matchmaking() -> None:
    """Make every averager created from now on (in this process and its forks) match with ``PacedMatchmaking``.
    Call before forking. hivemind's ``DecentralizedAverager`` builds its ``Matchmaking`` by this module-level name
    (pinned by tests/test_matchmaking.py)."""
    import hivemind.averaging.averager as averager

    averager.Matchmaking = PacedMatchmaking
