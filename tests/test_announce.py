"""A coordinator behind a port mapping (a container's published port, a NAT) announces the address it is given:
the swarm hears it and the portal offers it to joining workers, instead of addresses nobody outside can reach."""

from __future__ import annotations

import socket
import threading

import pytest

from tests.support.harness import free_port, wait_for


class Forwarder(threading.Thread):
    """``127.0.0.3:port`` forwarded to ``target``: what a container's published port does, on loopback."""

    def __init__(self, target: tuple[str, int]):
        super().__init__(daemon=True)
        self.target, self.connections = target, 0
        self.server = socket.create_server(("127.0.0.3", 0))
        self.port = self.server.getsockname()[1]

    def run(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:  # nothing listens there (yet, or any more): refused, as the mapped port would be
                client.close()
                continue
            self.connections += 1
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self.pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            try:
                sink.shutdown(socket.SHUT_WR)  # the other side sees the end; its own pump closes that socket
            except OSError:
                pass
            source.close()

    def close(self) -> None:
        self.server.close()


def test_announce_needs_a_fixed_listen_port(deployment):
    deployment.create_run()
    done = deployment.cli("coordinator", "--run", deployment.slug, "--announce", "/dns4/swarm.example.org/tcp/31337")
    assert done.returncode == 2 and "--announce needs --listen with a fixed port" in done.stderr, done.stderr
    done = deployment.cli("coordinator", "--run", deployment.slug, "--listen", "/ip4/127.0.0.1/tcp/31337",
                          "--announce", "/dns4/swarm.example.org/tcp/0")
    assert done.returncode == 2 and "must name a TCP port (not 0)" in done.stderr, done.stderr


@pytest.mark.swarm
def test_workers_join_through_the_announced_address(deployment):
    deployment.create_run()
    deployment.start_portal(wait=False)
    listen_port = free_port()
    forwarder = Forwarder(("127.0.0.1", listen_port))
    forwarder.start()
    announced = f"/ip4/127.0.0.3/tcp/{forwarder.port}"
    try:
        deployment.start("coordinator", "-m", "app.cli", "coordinator", "--run", deployment.slug,
                         "--listen", f"/ip4/127.0.0.1/tcp/{listen_port}",
                         env={"DEDLOC_ANNOUNCE_MADDRS": f'["{announced}"]'})
        [offered] = deployment.wait_for_coordinator()
        assert offered.startswith(f"{announced}/p2p/Qm") or offered.startswith(f"{announced}/p2p/12D3"), offered
        deployment.start_worker("alice")
        wait_for(lambda: deployment.swarm()["peers_online"] >= 1, 120, "the worker in the coordinator's swarm")
        assert forwarder.connections >= 1, "the worker did not come in through the announced address"
    finally:
        forwarder.close()
