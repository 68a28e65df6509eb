"""A small internet in network namespaces, for the benches and tests that need real links: a switch (a bridge
namespace) joining this machine (where the portal and coordinator run), open hosts, and home hosts each behind a
home router that masquerades (nftables). Any host's link can be shaped (``tc tbf``, as bench/emulate_averaging.py's
star) and pulled. ``close`` ends every process inside and removes all of it.

    this machine 10.231.0.254 ─┐
    open host    10.231.0.3  ──┼── switch (br0)                         (open host i: 10.231.0.(3 + 2i))
    router       10.231.0.2  ──┘   masquerade ── home host 192.168.77.2 (router j: 10.231.0.(2 + 2j),
                                                                          its host 192.168.(77 + j).2)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.emulate_averaging import namespaces_unavailable, shape

SERVER = "10.231.0.254"
QUEUE_MS = 50.0  # a home router's queue at its link's rate, milliseconds

MASQUERADE = """table ip nat {
  chain postrouting {
    type nat hook postrouting priority 100;
    oifname "wan0" masquerade
  }
}
"""


def open_address(index: int) -> str:
    return f"10.231.0.{3 + 2 * index}"


def router_address(index: int) -> str:
    return f"10.231.0.{2 + 2 * index}"


def home_address(index: int) -> str:
    return f"192.168.{77 + index}.2"


def home_gateway(index: int) -> str:
    """The home router's address on its host's side."""
    return f"192.168.{77 + index}.1"


# The first host of each kind, as the reachability tests name them
OPEN, ROUTER_WAN, HOME = open_address(0), router_address(0), home_address(0)


@dataclass(frozen=True)
class Link:
    """A host's access link, Mbit/s each way."""

    down: float
    up: float


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces with NAT and shaped links cannot be built here, or None: the emulation's own needs, and
    nftables for the routers."""
    if shutil.which("nft") is None:
        return "`nft` is not installed (apt-get install nftables)"
    return namespaces_unavailable()


class Internet:
    """The namespaces above. ``ns(name)`` names a host's namespace for ``ip netns exec``; ``address(name)`` is the
    address the host itself holds (a home host's is private: others see its router's).

    :param open_hosts: names of hosts on the switch, reachable from anywhere
    :param home_hosts: names of hosts behind a router of their own, which lets in nothing they did not start
    :param links: a shaped link for any of them (unshaped: the veth's speed)
    """

    def __init__(self, open_hosts: Sequence[str] = ("open",), home_hosts: Sequence[str] = ("home",),
                 links: Mapping[str, Link] | None = None) -> None:
        tag = os.getpid() % 100000
        self.prefix, self.uplink = f"dedloc-nat-{tag}-", f"dlc{tag}"
        self.open_hosts, self.home_hosts = list(open_hosts), list(home_hosts)
        self.created: list[str] = []
        try:
            self._build(dict(links or {}))
        except BaseException:
            self.close()
            raise

    def ns(self, name: str) -> str:
        return self.prefix + name

    def address(self, name: str) -> str:
        if name in self.open_hosts:
            return open_address(self.open_hosts.index(name))
        return home_address(self.home_hosts.index(name))

    def _build(self, links: dict[str, Link]) -> None:
        switch = self._add("switch")
        sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", switch, "link", "set", "br0", "up")
        # this machine's leg: a veth whose far end sits on the switch
        sh("ip", "link", "add", self.uplink, "type", "veth", "peer", "name", "up0", "netns", switch)
        sh("ip", "addr", "add", f"{SERVER}/24", "dev", self.uplink)
        sh("ip", "link", "set", self.uplink, "up")
        self._port(switch, "up0")
        for i, name in enumerate(self.open_hosts):
            self._wire(switch, self._add(name), f"p-o{i}", "eth0", open_address(i), links.get(name))
        for j, name in enumerate(self.home_hosts):
            router, home = self._add(f"r{j}"), self._add(name)
            self._wire(switch, router, f"p-r{j}", "wan0", router_address(j), links.get(name))
            gateway = home_gateway(j)
            sh("ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", home)
            sh("ip", "-n", router, "addr", "add", f"{gateway}/24", "dev", "lan0")
            sh("ip", "-n", router, "link", "set", "lan0", "up")
            sh("ip", "-n", home, "addr", "add", f"{home_address(j)}/24", "dev", "eth0")
            sh("ip", "-n", home, "link", "set", "eth0", "up")
            sh("ip", "-n", home, "route", "add", "default", "via", gateway)
            sh("ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            # A home router: connections out are masqueraded; nothing comes in that the home host did not start.
            subprocess.run(["ip", "netns", "exec", router, "nft", "-f", "-"], check=True, capture_output=True,
                           text=True, timeout=30, input=MASQUERADE)

    def _wire(self, switch: str, ns: str, port: str, dev: str, address: str, link: Link | None) -> None:
        sh("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns)
        self._port(switch, port)
        sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        if link is not None:
            shape(ns, dev, link.up, QUEUE_MS)  # upload: what leaves the host (or its router)
            shape(switch, port, link.down, QUEUE_MS)  # download: what the switch hands to it

    def _add(self, name: str) -> str:
        ns = self.ns(name)
        sh("ip", "netns", "add", ns)
        self.created.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    @staticmethod
    def _port(switch: str, dev: str) -> None:
        sh("ip", "-n", switch, "link", "set", dev, "master", "br0", "up")

    def link(self, name: str, up: bool) -> None:
        """Take a host's only link down (its cable pulled) or bring it back."""
        sh("ip", "-n", self.ns(name), "link", "set", "eth0", "up" if up else "down")
        if up and name in self.home_hosts:
            subprocess.run(["ip", "-n", self.ns(name), "route", "replace", "default", "via",
                            home_gateway(self.home_hosts.index(name))],
                           capture_output=True, timeout=30)

    def close(self) -> None:
        for ns in reversed(self.created):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:  # only processes we started live in namespaces we created
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()
        subprocess.run(["ip", "link", "del", self.uplink], capture_output=True)
