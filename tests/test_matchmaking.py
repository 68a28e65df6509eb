"""Matchmaking reads the group key at a bounded rate (dedloc_worker.matchmaking), on a real DHT."""

from __future__ import annotations

import asyncio
import gc
import time

import hivemind.averaging.averager as averager_module
import pytest
import torch
from dedloc_common.contract import OptimizerOptions, RunConfig
from dedloc_worker.matchmaking import READS_PER_WINDOW, Paced, PacedMatchmaking
from dedloc_worker.swarm import create_dht, create_optimizer
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
