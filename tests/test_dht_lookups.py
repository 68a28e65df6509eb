"""A store reuses its key's recent lookup (dedloc_worker.swarm.lookups), between two real DHT nodes on loopback."""

from __future__ import annotations

import asyncio

import pytest
from dedloc_worker.swarm import lookups as dht_lookups
from dedloc_worker.swarm.lookups import RemembersNearest
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

pytestmark = [pytest.mark.swarm, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def test_a_store_soon_after_another_of_its_key_looks_up_nothing(monkeypatch):
    async def scenario() -> list:
        other = await DHTNode.create(host_maddrs=LOOPBACK)
        node = await RemembersNearest.create(host_maddrs=LOOPBACK, initial_peers=await other.get_visible_maddrs())
        try:
            finds = []
            real = node.protocol.call_find

            async def counted(*args, **kwargs):
                finds.append(args)
                return await real(*args, **kwargs)

            node.protocol.call_find = counted
            seen = []

            async def store(value: int) -> None:
                before = len(finds)
                assert await node.store("key", value, get_dht_time() + 30)
                found = await other.get("key", latest=True)  # the store reached the other node
                seen.append((len(finds) - before, found.value if found else None))

            await store(1)  # the first store looks the key up
            await store(2)  # within LOOKUP_TTL: no lookup
            before = len(finds)
            assert (await node.get("key", latest=True)).value == 2
            seen.append((len(finds) - before, "get"))  # a get traverses as hivemind's does
            monkeypatch.setattr(dht_lookups, "LOOKUP_TTL", 0.0)
            await store(3)  # past the TTL: looked up again
            return seen
        finally:
            await node.shutdown()
            await other.shutdown()

    first, second, get, third = asyncio.run(scenario())
    assert first[0] >= 1 and first[1] == 1
    assert second == (0, 2)
    assert get[0] >= 1
    assert third[0] >= 1 and third[1] == 3
