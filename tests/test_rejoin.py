"""A peer whose DHT knows nobody (its link was down: every failed call dropped its callee from the routing table)
calls the run's bootstrap peers again and is back in the table (``swarm.rejoin``, which the admission keeper calls
every round; tests/test_reachability_netns.py pulls a real link). On loopback, with real hivemind peers."""

from __future__ import annotations

import functools
import gc
import time

import pytest
from dedloc_worker.swarm.node import create_dht, reach_peers, rejoin

pytestmark = [
    pytest.mark.swarm,
    # hivemind run in-process leaves its background event loops unclosed when garbage-collected.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


async def known_peers(_dht, node) -> list[str]:
    return sorted(str(peer_id) for peer_id in node.protocol.routing_table.uid_to_peer_id.values())


async def forget_everyone(_dht, node) -> None:
    """What a call that got no answer does to its callee, done to every peer this node knows."""
    for node_id in list(node.protocol.routing_table.uid_to_peer_id):
        del node.protocol.routing_table[node_id]


@pytest.fixture
def bootstrap_and_client():
    bootstrap = create_dht([], LOOPBACK, client_mode=False)
    client = None
    try:
        client = create_dht([str(a) for a in bootstrap.get_visible_maddrs()], LOOPBACK, client_mode=True)
        yield bootstrap, client
    finally:
        for dht in (client, bootstrap):
            if dht is not None:
                dht.shutdown()
        gc.collect()  # so hivemind's leftovers are reported here, under this module's warning filter


def test_a_peer_that_knows_nobody_calls_the_bootstrap_peer_and_is_back_in_its_table(bootstrap_and_client):
    bootstrap, client = bootstrap_and_client
    addrs = [str(a) for a in bootstrap.get_visible_maddrs()]  # /ip4/127.0.0.1/tcp/N/p2p/<id>, as the portal lists them
    assert client.run_coroutine(known_peers) == [str(bootstrap.peer_id)]
    assert client.run_coroutine(functools.partial(rejoin, addrs=addrs)) == (False, 0)  # it knows one: no call

    client.run_coroutine(forget_everyone)
    assert client.run_coroutine(known_peers) == []
    assert client.run_coroutine(functools.partial(rejoin, addrs=addrs)) == (True, 1)
    assert client.run_coroutine(known_peers) == [str(bootstrap.peer_id)]


def test_a_dead_address_counts_for_nothing_and_holds_nobody_up(bootstrap_and_client):
    bootstrap, client = bootstrap_and_client
    gone = create_dht([], LOOPBACK, client_mode=False)
    dead = [str(a) for a in gone.get_visible_maddrs()]
    gone.shutdown()  # a peer that left: nobody listens at its address any more
    live = [str(a) for a in bootstrap.get_visible_maddrs()]
    began = time.monotonic()
    assert client.run_coroutine(functools.partial(reach_peers, addrs=dead, timeout=5.0)) == 0
    assert client.run_coroutine(functools.partial(reach_peers, addrs=[*dead, *live], timeout=5.0)) == 1
    assert time.monotonic() - began < 15
