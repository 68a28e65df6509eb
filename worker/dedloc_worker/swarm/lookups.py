"""A DHT node that reuses the nodes it found for a key when it stores that key again soon after.

hivemind's ``DHTNode.store_many`` looks up the nodes nearest to a key before every store: a find RPC to each of
them, signed both ways, then the stores. A worker stores the same few keys every second or two (its progress, its
matchmaking declarations), so about a third of its find RPCs were those lookups, finding the same nodes each time
(docs/hivemind.md#pitfalls, 25). ``RemembersNearest`` keeps a store's lookup for ``LOOKUP_TTL`` seconds; lookups
of other kinds (a get, the routing table's refresh) are hivemind's own.
"""

from __future__ import annotations

import time
from typing import Dict, Tuple

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID

# Seconds a store reuses a lookup of its key. A node that joined meanwhile receives the key's stores after this at
# the latest (gets still find the key where it is); a node that left fails that store, which hivemind's stores
# tolerate (the other replicas take it).
LOOKUP_TTL = 5.0
MAX_REMEMBERED = 256


class RemembersNearest(DHTNode):
    """``DHTNode`` whose stores reuse their key's lookup for ``LOOKUP_TTL`` seconds."""

    async def find_nearest_nodes(self, queries, k_nearest=None, beam_size=None, num_workers=None,
                                 node_to_peer_id=None, exclude_self=False, found_callback=None, **kwargs):
        if found_callback is None:  # only a store passes a callback: every other lookup runs as hivemind's
            return await super().find_nearest_nodes(queries, k_nearest, beam_size, num_workers, node_to_peer_id,
                                                    exclude_self, **kwargs)
        remembered: Dict[DHTID, Tuple[float, Dict[DHTID, PeerID]]] = self.__dict__.setdefault("_remembered", {})
        now = time.monotonic()
        if len(remembered) > MAX_REMEMBERED:  # keys stored once (a claim's acknowledgement) would pile up
            for query in [query for query, (found_at, _) in remembered.items() if now - found_at >= LOOKUP_TTL]:
                del remembered[query]
        fresh = {query: self._filter_blacklisted(remembered[query][1]) for query in queries
                 if query in remembered and now - remembered[query][0] < LOOKUP_TTL}
        for query, nearest in fresh.items():
            if node_to_peer_id is not None:
                node_to_peer_id.update(nearest)
            await found_callback(query, list(nearest), set())
        rest = [query for query in queries if query not in fresh]
        if not rest:
            return {}  # a store reads only what its callback was given

        async def remember(query: DHTID, nearest, visited) -> None:
            known = node_to_peer_id or {}
            remembered[query] = (time.monotonic(), {node: known[node] for node in nearest if node in known})
            await found_callback(query, nearest, visited)

        return await super().find_nearest_nodes(rest, k_nearest, beam_size, num_workers, node_to_peer_id,
                                                exclude_self, found_callback=remember, **kwargs)
