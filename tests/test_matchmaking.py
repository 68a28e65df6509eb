"""Matchmaking reads the group key at a bounded rate (dedloc_worker.averaging.matchmaking), on a real DHT."""

from __future__ import annotations

import asyncio
import gc
import time

import hivemind.averaging.averager as averager_module
import pytest
import torch
from dedloc_common.contract import OptimizerOptions, RunConfig
from dedloc_worker.averaging.matchmaking import READS_PER_WINDOW, Paced, PacedMatchmaking
from dedloc_worker.swarm.node import create_dht
from dedloc_worker.training.options import create_optimizer
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking

pytestmark = [pytest.mark.swarm, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


def paced_reads(interval: float, seconds: float) -> tuple[int, float]:
    """Read a real group key back to back for ``seconds``, paced: how many reads, and how long the first took."""
    dht = create_dht([], "/ip4/127.0.0.1/tcp/0", client_mode=False)
    try:
        keys = GroupKeyManager(dht, "pace-test", initial_group_bits="", target_group_size=2)
        read = Paced(keys.get_averagers, interval)

        async def read_for() -> tuple[int, float]:
            start = time.monotonic()
            await read(keys.current_key, True)
            first, reads = time.monotonic() - start, 1
            while time.monotonic() - start < seconds:  # back to back, as hivemind's queue updater reads
                await read(keys.current_key, True)
                reads += 1
            return reads, first

        return asyncio.run(read_for())
    finally:
        dht.shutdown()


def test_reads_of_the_group_key_are_paced_and_the_first_is_immediate():
    interval = 0.2
    reads, first = paced_reads(interval, 2.0)
    gc.collect()  # the DHT's sockets close here, where the mark above expects their warnings
    # Unpaced, a read here returns in ~10 ms: some 200 in 2 s. Paced, one every 0.2 s at most, plus the first.
    assert reads <= 2.0 / interval + 2, reads
    assert reads >= 3, reads  # and they do go on
    assert first < interval, first  # the first read does not wait


def test_a_workers_averagers_are_built_with_the_paced_matchmaking():
    original = averager_module.Matchmaking
    averager_module.Matchmaking = Matchmaking  # as hivemind ships it
    dht = create_dht([], "/ip4/127.0.0.1/tcp/0", client_mode=False)
    try:
        config = RunConfig(slug="pace", run_id="pace", task="tiny-lm", target_batch_size=64, batch_size=16,
                           optimizer=OptimizerOptions(matchmaking_time=0.5, averaging_timeout=2.0))
        opt = create_optimizer(dht, config, torch.nn.Linear(4, 1).parameters(), client_mode=False)
        try:
            # installed before the averagers' processes forked, so they match with it too
            assert averager_module.Matchmaking is PacedMatchmaking and issubclass(PacedMatchmaking, Matchmaking)
            assert opt.grad_averager.is_alive() and opt.state_averager.is_alive()
        finally:
            opt.shutdown()
    finally:
        dht.shutdown()
        averager_module.Matchmaking = original
        gc.collect()
    assert READS_PER_WINDOW >= 2


def late_partner(matchmaking: type) -> tuple[BaseException | None, bool, bool]:
    """Peer A looks for a group alone (round due in 0.5 s, deadline 10 s); peer B's round starts 3 s later, as a
    partner's round of the next epoch does. With ``matchmaking`` in both averagers: how A's round ended, whether it
    had ended before B's began, and whether A and B averaged together."""
    original = averager_module.Matchmaking
    averager_module.Matchmaking = matchmaking  # the averagers' processes fork with it
    first = create_dht([], "/ip4/127.0.0.1/tcp/0", client_mode=False)
    second = create_dht([str(a) for a in first.get_visible_maddrs()], "/ip4/127.0.0.1/tcp/0", client_mode=False)
    averagers = []
    try:
        for dht in (first, second):
            averagers.append(averager_module.DecentralizedAverager(
                [torch.zeros(8)], dht, prefix="look-test", target_group_size=2, min_matchmaking_time=0.5,
                request_timeout=0.5, start=True))
        a, b = averagers
        round_a = a.step(wait=False, timeout=10.0)
        time.sleep(3.0)
        ended_before = round_a.done()
        round_b = b.step(wait=False, timeout=10.0)
        error_a = round_a.exception(timeout=15.0)
        error_b = round_b.exception(timeout=15.0)
        together = error_a is None and error_b is None and len(round_a.result()) == 2
        return error_a, ended_before, together
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in (second, first):
            dht.shutdown()
        averager_module.Matchmaking = original
        gc.collect()


def test_a_round_that_missed_its_group_ends_instead_of_taking_the_next_epochs_round():
    """docs/hivemind.md#pitfalls, 22: looking until its deadline, a round left alone forms with its partner's next
    round, and the peer stays a round behind for the rest of the run."""
    error, ended_before, together = late_partner(Matchmaking)
    assert together and error is None and not ended_before, error  # control: hivemind's round takes the late one
    error, ended_before, together = late_partner(PacedMatchmaking)
    assert not together
    assert "could not find a group" in str(error), error
    assert ended_before  # given up within its window (1.5 s), before the partner's next round began
