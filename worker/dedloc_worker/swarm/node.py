"""A worker's DHT node (the coordinator's too): ``SwarmDHT`` (docs/hivemind.md#pitfalls 14 and 25), its relays,
reaching the run's bootstrap peers again. The pitfalls of the optimizer and where each is handled:
``training.options``."""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Callable, List, Optional, Sequence

import hivemind

from dedloc_worker.errors import DHT_FAILURES


class _StaleRequestsDropped:
    """The DHT process's end of its request pipe. A request carries its reply pipe as a descriptor that the sending
    process hands over when the request is read; one whose sender has left meanwhile reads as a no-op request."""

    def __init__(self, pipe) -> None:
        self._pipe = pipe

    def recv(self):
        # Blocking, whoever made it otherwise: the DHT's process shares this end's file description with the worker
        # that forked it, and once read non-blocking, a request still arriving raised EAGAIN halfway, the next read
        # began mid-message and the DHT process died of it (a soak run's worker, which then hung at Ctrl-C)
        os.set_blocking(self._pipe.fileno(), True)
        try:
            return self._pipe.recv()
        except (FileNotFoundError, ConnectionRefusedError):  # the sender's descriptor server is gone with it
            return "_drop_stale_request", [], {}

    def __getattr__(self, name: str):
        return getattr(self._pipe, name)


class SwarmDHT(hivemind.DHT):
    """hivemind's DHT that drops a request whose sender left before it was read (pitfall 14), and whose node reuses
    a store's lookup (``swarm.lookups``, pitfall 25)."""

    def run(self) -> None:  # in the DHT's own process
        import hivemind.dht.dht

        from dedloc_worker.swarm.lookups import RemembersNearest

        self._inner_pipe = _StaleRequestsDropped(self._inner_pipe)
        hivemind.dht.dht.DHTNode = RemembersNearest  # the node hivemind's run creates, in this process only
        super().run()

    async def _drop_stale_request(self) -> None:
        pass  # nobody waits for its answer


def create_dht(initial_peers: Sequence[str], listen: str, client_mode: bool, identity_path: Optional[str] = None,
               authorizer=None, unreachable: bool = False):
    """Start this process's DHT node (a child process plus its p2pd daemon) and wait until it is up.

    :param authorizer: checks every DHT request and response (``admission.gate.RunAuthorizer``); None admits all
    :param unreachable: the portal's dial-back found this machine unreachable (see ``relay_options``)
    """
    gc.freeze()  # pitfall 13
    return SwarmDHT(
        initial_peers=list(initial_peers),
        host_maddrs=[listen],
        client_mode=client_mode,
        identity_path=identity_path,
        authorizer=authorizer,
        # the key is new in every process (identity.PeerIdentity), so hivemind's check that no peer uses it, a second
        # p2pd that dials our own PeerID, would cost every start a quarter second (more on busy cores) for nothing
        check_if_identity_free=False,
        start=True,
        **relay_options(client_mode, initial_peers, unreachable),
    )


def relay_options(client_mode: bool, initial_peers: Sequence[str], unreachable: bool = False) -> dict:
    """hivemind's relay arguments for this peer's DHT (docs/hivemind.md#relays).

    Every peer runs p2pd with circuit relay on (``use_relay``, also hivemind's default): it can dial through relays,
    and a full peer offers relay service to peers behind NAT. A client-mode peer also looks for relays to receive
    through (``use_auto_relay``), the run's bootstrap peers first (``trusted_relays``); one the portal found
    unreachable says so (``force_reachability="private"``), since libp2p reserves relay slots only for a node it
    believes private, and AutoNAT in a small swarm may never decide.
    """
    if not client_mode:
        return dict(use_relay=True)
    options = dict(use_relay=True, use_auto_relay=True)
    relays = [addr for addr in initial_peers if _names_a_peer(addr)]
    if relays:
        options["trusted_relays"] = relays
    if unreachable:
        options["force_reachability"] = "private"
    return options


def _names_a_peer(addr: str) -> bool:
    """A multiaddr p2pd accepts as a relay: parses, ends in /p2p/<id>, is no relayed address itself (p2pd exits
    on one it cannot parse)."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        return bool(Multiaddr(addr).value_for_protocol("p2p")) and "/p2p-circuit" not in addr
    except Exception:
        return False


def relay_addresses(dht) -> List[str]:
    """This node's relayed addresses (``.../p2p-circuit``): where it receives through a relay. libp2p lists one
    once a relay with a public address has granted it a slot. Asked of p2pd each time: hivemind's
    ``get_visible_maddrs`` otherwise answers what the daemon listed at start, before any relay."""
    return [str(addr) for addr in dht.get_visible_maddrs(latest=True) if "/p2p-circuit" in str(addr)]


RELAY_WAIT = 300.0  # seconds: libp2p's autorelay reserves a slot after 3 minutes when it knows fewer than 4 relays
RELAY_POLL = 10.0  # seconds between two looks at this node's addresses


class RelayWatch(threading.Thread):
    """Tells a client-mode peer's user when it receives through a relay (a relay granted it a slot and it lists a
    relayed address), and when it stops; once, if no relay granted it a slot within ``wait`` seconds
    (docs/hivemind.md#relays).

    :param addresses: () -> this node's relayed addresses (``relay_addresses`` of its DHT)
    :param say: prints one line
    """

    def __init__(self, addresses: Callable[[], List[str]], say: Callable[[str], None], wait: float = RELAY_WAIT,
                 interval: float = RELAY_POLL):
        super().__init__(name="dedloc-relay-watch", daemon=True)
        self.addresses, self.say, self.wait, self.interval = addresses, say, wait, interval
        self.relayed: List[str] = []  # the relayed addresses seen last
        self.halted = threading.Event()

    def run(self) -> None:
        began, told_none = time.monotonic(), False
        while not self.halted.wait(self.interval):
            try:
                relayed = sorted(self.addresses())
            except DHT_FAILURES:  # the DHT busy or shutting down: look again next time
                continue
            if relayed and relayed != self.relayed:
                self.say(f"relay: receiving through {relayed[0]}: libp2p can reach this machine through the "
                         "relay; in client mode it still only sends (docs/hivemind.md#relays)")
            elif self.relayed and not relayed:
                self.say("relay: the relay dropped this machine's slot; libp2p looks for another")
            elif not relayed and not told_none and time.monotonic() - began > self.wait:
                self.say(f"relay: no relay granted this machine a slot in {self.wait / 60:.0f} minutes (a relay "
                         "needs a public address); it receives nothing, which client mode does not need")
                told_none = True
            self.relayed = relayed

    def halt(self, timeout: float = 10.0) -> None:
        self.halted.set()
        self.join(timeout=timeout)


REACH_TIMEOUT = 10.0  # seconds one dial and ping of ``reach_peers`` may take


async def reach_peers(_dht, node, addrs: Sequence[str], timeout: float = REACH_TIMEOUT) -> int:
    """Run in the DHT process (``dht.run_coroutine``): connect to and ping each multiaddr (with /p2p/ID), all at
    once and each within ``timeout`` seconds; how many answered. Both sides then hold each other in their routing
    tables, which a peer that was away for a while (a restarted coordinator) no longer is; a client-mode peer whose
    link was down holds nobody, for every call that failed meanwhile dropped its callee from the table."""
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    async def reach(addr: str) -> bool:
        try:
            maddr = Multiaddr(addr)
            peer_id = PeerID.from_base58(maddr.value_for_protocol("p2p"))
            # p2pd cannot decode the /p2p/ part as hivemind's Multiaddr encodes it ("length greater than remaining
            # number of bytes in buffer"): dial the transport address, the peer named apart.
            transport = maddr.decapsulate(Multiaddr(f"/p2p/{peer_id}"))
            # hivemind has no public call for this
            await asyncio.wait_for(node.p2p._client.connect(peer_id, [transport]), timeout)
            return await asyncio.wait_for(node.protocol.call_ping(peer_id), timeout) is not None
        except Exception:  # an address gone stale, or the network still down: another may answer
            return False

    reached = sum(await asyncio.gather(*(reach(addr) for addr in addrs)))
    if reached:
        # The network is back: forget who failed to answer during the outage. hivemind skips a peer that failed
        # for ever longer (5 s, doubled per failure), so after half a minute offline it would skip them for minutes.
        node.blacklist.clear()
    return reached


async def rejoin(_dht, node, addrs: Sequence[str], always: bool = False, timeout: float = REACH_TIMEOUT):
    """Run in the DHT process: (whether this node knew no peer, how many of ``addrs`` answered). It dials
    ``addrs`` (``reach_peers``) when it knows no peer, or ``always``; a node that knows peers and is not told
    ``always`` dials nobody."""
    alone = not node.protocol.routing_table.uid_to_peer_id
    if not (alone or always):
        return False, 0
    return alone, await reach_peers(_dht, node, addrs, timeout)
