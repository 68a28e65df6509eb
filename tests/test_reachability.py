"""The portal's dial-back (``POST /api/v1/runs/{slug}/reachability``) against real listeners on loopback: a
hivemind peer answers as libp2p; a closed port, a silent listener and a plain TCP server do not, each with its
reason; only the caller's own address is dialed. The same through a portal served on loopback, as a worker asks."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest

from app.identity.accounts import issue_credential, sign_in_locally
from app.runs import registry
from app.runs.reachability import dial_back, tcp_endpoint
from tests.support.harness import free_port


@pytest.fixture(scope="module")
def libp2p_peer():
    """A real hivemind DHT node on loopback: its TCP port and its announced multiaddr."""
    import hivemind

    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        addr = str(dht.get_visible_maddrs()[0])
        yield tcp_endpoint(addr)[1], addr
    finally:
        dht.shutdown()


class Listener(threading.Thread):
    """Accepts connections on loopback and writes ``answer`` (nothing: a silent one), then holds them open."""

    def __init__(self, answer: bytes):
        super().__init__(daemon=True)
        self.answer, self.server = answer, socket.create_server(("127.0.0.1", 0))
        self.port, self.held = self.server.getsockname()[1], []

    def run(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            connection.sendall(self.answer)
            self.held.append(connection)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.server.close()
        for connection in self.held:
            connection.close()


def test_a_libp2p_peer_is_reachable_and_other_listeners_are_not_each_with_its_reason(libp2p_peer):
    port, addr = libp2p_peer
    with Listener(b"") as silent, Listener(b"HTTP/1.1 400 Bad Request\r\n\r\n") as web:
        closed = free_port()
        report = asyncio.run(dial_back([addr, f"/ip4/127.0.0.1/tcp/{closed}", f"/ip4/127.0.0.1/tcp/{silent.port}",
                                        f"/ip4/127.0.0.1/tcp/{web.port}", "/dns4/example.org/tcp/1"],
                                       "127.0.0.1", timeout=1.0))
    assert report.reachable and report.seen_from == "127.0.0.1"
    verdicts = [(check.reachable, check.reason.split(" (")[0]) for check in report.checks]
    assert verdicts == [(True, "a libp2p peer answered"), (False, "connection refused"),
                        (False, "no answer within 1 s"), (False, "something answered, but not a libp2p peer"),
                        (False, "not an /ip4/ or /ip6/ TCP address: not dialed")]
    assert report.checks[0].dialed == f"127.0.0.1:{port}" and report.checks[-1].dialed is None


def test_only_the_callers_own_address_is_dialed(libp2p_peer):
    """A worker behind NAT announces its private address; the portal dials the address it sees instead (so no
    caller can make it dial another host), and says both."""
    port, _ = libp2p_peer
    report = asyncio.run(dial_back([f"/ip4/10.9.8.7/tcp/{port}"], "127.0.0.1", timeout=1.0))
    [check] = report.checks
    assert check.dialed == f"127.0.0.1:{port}" and check.reachable
    assert "the worker announced 10.9.8.7, the portal sees it at 127.0.0.1" in check.reason
    unreachable = asyncio.run(dial_back([f"/ip4/127.0.0.1/tcp/{free_port()}"], "127.0.0.1", timeout=1.0))
    assert not unreachable.reachable and "the portal dialed back each port" in unreachable.how


def portal_with_run(start_portal):
    """A portal serving run "demo", and a credential of alice's for it."""
    portal = start_portal()
    with portal.db() as session:
        registry.create_run(session, slug="demo", title="Demo")
        credential = issue_credential(session, user_id=sign_in_locally(session, username="alice").id)
        session.commit()
    return portal, credential


def test_a_worker_asks_the_portal_which_dials_it_back(start_portal, libp2p_peer):
    from dedloc_worker.portal.client import check_reachability

    portal, credential = portal_with_run(start_portal)
    port, addr = libp2p_peer
    report = check_reachability(portal.url, "demo", credential, [addr])
    assert report is not None and report.reachable and report.checks[0].dialed == f"127.0.0.1:{port}"
    closed = check_reachability(portal.url, "demo", credential, [f"/ip4/127.0.0.1/tcp/{free_port()}"])
    assert closed is not None and not closed.reachable and "connection refused" in closed.checks[0].reason
    url = f"{portal.url}/api/v1/runs/demo/reachability"
    assert httpx.post(url, json={"addrs": [addr]}).status_code == 401  # signed-in callers only
    too_many = httpx.post(url, json={"addrs": [addr] * 17}, headers={"Authorization": f"Bearer {credential}"})
    assert too_many.status_code == 422


def test_while_the_portal_cannot_be_reached_the_worker_asks_again_and_takes_its_verdict(start_portal, libp2p_peer):
    from dedloc_worker.portal.client import check_reachability

    from tests.support.oidc_provider import LoopbackServer

    portal, credential = portal_with_run(start_portal)
    # the portal restarting: its port bound, nothing accepted (refused) for the first 2.5 s
    late = LoopbackServer(portal.app)
    threading.Timer(2.5, late.__enter__).start()
    said: list[str] = []
    try:
        report = check_reachability(late.url, "demo", credential, [libp2p_peer[1]], retries=(1.0,) * 6,
                                    say=said.append)
    finally:
        late.__exit__(None, None, None)
    assert report is not None and report.reachable
    assert 2 <= len(said) <= 4 and all("cannot dial this machine back now (ConnectError" in line and
                                       line.endswith("asking again in 1 s") for line in said), said
    # a portal that stays away: the worker gives up after its tries and says nothing it does not know
    said.clear()
    gone = f"http://127.0.0.1:{free_port()}"
    assert check_reachability(gone, "demo", credential, [libp2p_peer[1]], retries=(0.1, 0.1), say=said.append) is None
    assert len(said) == 2
