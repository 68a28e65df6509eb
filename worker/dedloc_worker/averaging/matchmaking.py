"""Matchmaking that reads the DHT at a bounded rate, and gives up on a round once its time has passed.

While a peer looks for its averaging group and no leader is queued, hivemind's ``PotentialLeaders`` reads the group
key again the moment the last read returns: measured here, a read every ~12 ms (80 a second) for as long as a peer
waits for the others, each read a set of signed DHT RPCs. In a two-worker tiny-lm swarm that was 7.5 reads a
second per worker on average, most of its DHT process's CPU (docs/benchmarks.md#where-a-swarm-spends-its-cpu). A
follower finds its leader at its first read, which stays immediate; the later reads only catch leaders that declared
after it, and ``READS_PER_WINDOW`` reads per matchmaking window catch them in time.

hivemind looks for a round's group until the round's deadline (its averaging timeout: 5 s on loopback, 60 s by
default), and a peer's next round waits behind that look. A gradient round that missed its partners' round at one
epoch then forms with their round of the next epoch, its next round with the one after, and so on: the peer stays a
round behind for the rest of the run, its state rounds a step late (lost at every state-averaging step), its steps
waiting for its partners' next step (docs/hivemind.md#pitfalls, 22). So a look ends ``LOOK_WINDOWS`` matchmaking
times after the round's scheduled time: a round that missed its group is "no group this time", and the next one
starts level with the others'.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Optional, TypeVar

from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import cancel_and_wait

READS_PER_WINDOW = 5  # reads of the group key per min_matchmaking_time, at most
LOOK_WINDOWS = 2  # a round looks for its group until this many min_matchmaking_time past its scheduled time
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
    """hivemind's ``Matchmaking``, reading the group key at most ``READS_PER_WINDOW`` times per matchmaking time and
    looking for a round's group until ``LOOK_WINDOWS`` matchmaking times past its scheduled time at most."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        keys = self.group_key_manager
        keys.get_averagers = Paced(keys.get_averagers, self.min_matchmaking_time / READS_PER_WINDOW)

    def look_timeout(self, step: StepControl) -> float:
        """Seconds left to look for ``step``'s group: to its scheduled time plus the window, within its deadline."""
        give_up = min(step.scheduled_time + LOOK_WINDOWS * self.min_matchmaking_time, step.deadline)
        return max(0.0, give_up - get_dht_time())

    async def look_for_group(self, step: StepControl) -> Optional[GroupInfo]:
        """hivemind 1.1.12's ``look_for_group`` with ``look_timeout`` in place of the round's whole deadline."""
        async with self.looking_for_group(step):
            request_leaders_task = asyncio.create_task(self._request_join_potential_leaders(step))
            try:
                return await asyncio.wait_for(self.assembled_group, timeout=self.look_timeout(step))
            except asyncio.TimeoutError:
                # hivemind retries a round that found no group until its deadline; past its window each retry
                # would give up at once, again and again: the round ends here
                step._allow_retries = False
                return None
            except BaseException as e:
                if len(self.current_followers) > 0:
                    async with self.lock_request_join_group:
                        await self.leader_disband_group()
                if not self.assembled_group.done():
                    self.assembled_group.set_exception(e)
                raise
            finally:
                await cancel_and_wait(request_leaders_task)
                self.assembled_group.cancel()
                while len(self.current_followers) > 0:
                    await self.follower_was_discarded.wait()
                    self.follower_was_discarded.clear()
                # as hivemind: every follower is sent away before the next look gets a new future
                self.assembled_group = asyncio.Future()
                self.was_accepted_to_group.clear()


def pace_matchmaking() -> None:
    """Make every averager created from now on (in this process and its forks) match with ``PacedMatchmaking``.
    Call before forking. hivemind's ``DecentralizedAverager`` builds its ``Matchmaking`` by this module-level name
    (pinned by tests/test_matchmaking.py)."""
    import hivemind.averaging.averager as averager

    averager.Matchmaking = PacedMatchmaking
