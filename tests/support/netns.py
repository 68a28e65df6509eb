"""A small internet in network namespaces for the reachability tests: a switch (a bridge namespace) joining this
machine (where the portal and coordinator run), an open host, and a home router that masquerades (nftables) a home
host behind it. Built like bench/emulate_averaging.py's star; ``close`` ends every process inside and removes all.

    this machine 10.231.0.254 ─┐
    open host    10.231.0.3  ──┼── switch (br0)
    router       10.231.0.2  ──┘   masquerade ── home host 192.168.77.2
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

SERVER, OPEN, ROUTER_WAN = "10.231.0.254", "10.231.0.3", "10.231.0.2"
HOME, HOME_GATEWAY = "192.168.77.2", "192.168.77.1"

MASQUERADE = """table ip nat {
  chain postrouting {
    type nat hook postrouting priority 100;
    oifname "wan0" masquerade
  }
}
"""


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces with NAT cannot be built here, or None."""
    if os.geteuid() != 0:
        return "not root: network namespaces need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 nftables)"
    return None


class Internet:
    """The namespaces above; ``ns("open")`` / ``ns("home")`` name the hosts' namespaces for ``ip netns exec``."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.prefix, self.uplink = f"dedloc-nat-{tag}-", f"dlc{tag}"
        self.created: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def ns(self, name: str) -> str:
        return self.prefix + name

    def _build(self) -> None:
        switch, open_, router, home = (self._add(name) for name in ("switch", "open", "router", "home"))
        sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", switch, "link", "set", "br0", "up")
        # this machine's leg: a veth whose far end sits on the switch
        sh("ip", "link", "add", self.uplink, "type", "veth", "peer", "name", "up0", "netns", switch)
        sh("ip", "addr", "add", f"{SERVER}/24", "dev", self.uplink)
        sh("ip", "link", "set", self.uplink, "up")
        self._port(switch, "up0")
        for ns, port, dev, addr in ((open_, "p-open", "eth0", OPEN), (router, "p-router", "wan0", ROUTER_WAN)):
            sh("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns)
            self._port(switch, port)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", home)
        sh("ip", "-n", router, "addr", "add", f"{HOME_GATEWAY}/24", "dev", "lan0")
        sh("ip", "-n", router, "link", "set", "lan0", "up")
        sh("ip", "-n", home, "addr", "add", f"{HOME}/24", "dev", "eth0")
        sh("ip", "-n", home, "link", "set", "eth0", "up")
        sh("ip", "-n", home, "route", "add", "default", "via", HOME_GATEWAY)
        sh("ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        # A home router: connections out are masqueraded; nothing comes in that the home host did not start.
        subprocess.run(["ip", "netns", "exec", router, "nft", "-f", "-"], check=True, capture_output=True, text=True,
                       timeout=30, input=MASQUERADE)

    def _add(self, name: str) -> str:
        ns = self.ns(name)
        sh("ip", "netns", "add", ns)
        self.created.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _port(self, switch: str, dev: str) -> None:
        sh("ip", "-n", switch, "link", "set", dev, "master", "br0", "up")

    def link(self, name: str, up: bool) -> None:
        """Take a host's only link down (its cable pulled) or bring it back."""
        dev = "eth0"
        sh("ip", "-n", self.ns(name), "link", "set", dev, "up" if up else "down")
        if up and name == "home":
            subprocess.run(["ip", "-n", self.ns(name), "route", "replace", "default", "via", HOME_GATEWAY],
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
