"""The `tcp` mode of the averaging emulation: a round's traffic as plain TCP, the transport's own limit.

A round of an all-to-all split (hivemind's, the planner's) moves, between each pair of peers i and j, i's part for j
and j's averaged results of i's share one way, and the same mirrored the other: V * (s_i + s_j) bytes each way,
over one connection per pair, as libp2p keeps them. Here those bytes go over plain sockets, with no dependency
between them: no daemon, no encryption, no reducer waiting for every sender's part. What a split loses to the links'
TCP sharing shows here; what it loses beyond that is the all-reduce's own (docs/benchmarks.md#what-limits-4x100).

Runs inside a peer process of ``bench.emulate_averaging``; connections stay open from round to round.
"""

from __future__ import annotations

import socket
import threading
import time

PORT = 29501  # RING_PORT + 1
CHUNK = 1 << 20
DIAL_SECONDS = 30.0

_links: dict[int, socket.socket] = {}


def dials(i: int, j: int, clients: list[bool]) -> bool:
    """Whether peer i opens the connection to peer j: a client-mode peer accepts none, so it dials; else the later."""
    if clients[i] != clients[j]:
        return clients[i]
    return i > j


def connect(index: int, ips: list[str], clients: list[bool]) -> None:
    """Open (once) this peer's connection to every other peer."""
    if _links:
        return
    others = [j for j in range(len(ips)) if j != index]
    inbound = [j for j in others if not dials(index, j, clients)]
    listener = None
    if inbound:
        listener = socket.create_server((ips[index], PORT), backlog=len(inbound))
        threading.Thread(target=_accept, args=(listener, len(inbound)), daemon=True).start()
    for j in others:
        if dials(index, j, clients):
            _links[j] = _dial(ips[j], index)
    deadline = time.monotonic() + DIAL_SECONDS
    while len(_links) < len(others):
        if time.monotonic() > deadline:
            raise TimeoutError(f"peers {sorted(set(others) - set(_links))} did not connect")
        time.sleep(0.01)
    if listener is not None:
        listener.close()


def _dial(ip: str, index: int) -> socket.socket:
    deadline = time.monotonic() + DIAL_SECONDS
    while True:
        try:
            sock = socket.create_connection((ip, PORT), timeout=DIAL_SECONDS)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    sock.settimeout(None)
    sock.sendall(bytes([index]))
    return sock


def _accept(listener: socket.socket, count: int) -> None:
    for _ in range(count):
        sock, _ = listener.accept()
        _links[sock.recv(1)[0]] = sock


def exchange(volumes: list[int], index: int) -> tuple[float, float, int]:
    """Send ``volumes[j]`` bytes to every other peer j while receiving as many from it; returns (began, ended, bytes
    received). Both ends of a pair are given the same volume."""
    payload = memoryview(bytes(CHUNK))
    received = [0] * len(volumes)

    def send(j: int) -> None:
        left = volumes[j]
        while left > 0:
            left -= _links[j].send(payload[:min(left, CHUNK)])

    def receive(j: int) -> None:
        buffer = bytearray(CHUNK)
        while received[j] < volumes[j]:
            got = _links[j].recv_into(buffer, min(CHUNK, volumes[j] - received[j]))
            if not got:
                raise ConnectionError(f"peer {j} closed the connection")
            received[j] += got

    threads = [threading.Thread(target=work, args=(j,)) for j in _links for work in (send, receive)]
    began = time.time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return began, time.time(), sum(received)
