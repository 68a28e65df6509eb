"""The dial-back that decides whether a worker can be a full peer: the portal opens a TCP connection to each port
the worker announces, at the address the worker's request came from, and waits for libp2p's greeting (the
multistream-select header a libp2p listener sends first). Plain sockets: the web process never imports hivemind.

Only the caller's own address is dialed, never the addresses it names: the portal must not become a port
scanner of other hosts (an announced address that differs, a private one behind NAT, is reported, not dialed).
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Optional

from dedloc_common.contract import AddressCheck, ReachabilityReport

GREETING = b"\x13/multistream/1.0.0\n"  # what a libp2p listener writes as soon as a connection opens
DIAL_TIMEOUT = 3.0  # seconds per address: a NAT or firewall that drops packets answers nothing at all
HOW = ("the portal dialed back each port this worker announced, at the address its request came from, and "
       "waited {timeout:.0f} s for a libp2p peer to answer")


def tcp_endpoint(addr: str) -> Optional[tuple[str, int]]:
    """(ip, port) of an /ip4/ or /ip6/ TCP multiaddr; None for anything else (DNS names, relays, QUIC)."""
    parts = addr.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    try:
        ip, port = ipaddress.ip_address(parts[2]), int(parts[4])
    except ValueError:
        return None
    return (str(ip), port) if 0 < port < 65536 else None


async def dial(host: str, port: int, timeout: float) -> tuple[bool, str]:
    """(answered as libp2p, what happened in words)."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        greeting = await asyncio.wait_for(reader.readexactly(len(GREETING)), timeout)
    except asyncio.TimeoutError:
        return False, f"no answer within {timeout:.0f} s (a NAT or firewall drops incoming connections)"
    except ConnectionRefusedError:
        return False, "connection refused (nothing listens there for outsiders: a NAT, or a closed port)"
    except asyncio.IncompleteReadError:
        return False, "the connection opened but closed before any libp2p greeting"
    except OSError as e:
        return False, f"cannot connect ({e.strerror or e})"
    finally:
        if writer is not None:
            writer.close()
    if greeting != GREETING:
        return False, "something answered, but not a libp2p peer"
    return True, "a libp2p peer answered"


async def dial_back(addrs: list[str], seen_from: str, timeout: float = DIAL_TIMEOUT) -> ReachabilityReport:
    """Dial ``seen_from`` on each port of ``addrs``; every port is dialed once, all at the same time."""
    endpoints = {addr: tcp_endpoint(addr) for addr in addrs}
    ports = sorted({endpoint[1] for endpoint in endpoints.values() if endpoint})
    results = dict(zip(ports, await asyncio.gather(*(dial(seen_from, port, timeout) for port in ports))))
    checks = []
    for addr, endpoint in endpoints.items():
        if endpoint is None:
            checks.append(AddressCheck(addr=addr, dialed=None, reachable=False,
                                       reason="not an /ip4/ or /ip6/ TCP address: not dialed"))
            continue
        answered, reason = results[endpoint[1]]
        if endpoint[0] != seen_from:
            reason += f"; the worker announced {endpoint[0]}, the portal sees it at {seen_from}"
        checks.append(AddressCheck(addr=addr, dialed=_host_port(seen_from, endpoint[1]), reachable=answered,
                                   reason=reason))
    return ReachabilityReport(reachable=any(check.reachable for check in checks), seen_from=seen_from,
                              checks=checks, how=HOW.format(timeout=timeout))


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
