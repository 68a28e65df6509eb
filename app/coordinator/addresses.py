"""The coordinator's listen and announced addresses, checked without hivemind's import (seconds), so that the CLI
refuses a wrong one at once."""

from __future__ import annotations

from app.core.errors import Invalid


def announced_maddrs(announce: list[str], listen: str | None) -> list[str]:
    """The addresses to announce, checked: multiaddrs with an explicit port, and a listen address with a fixed
    port (the one a port mapping or a container's published port leads to); ``Invalid`` with the reason."""
    if not announce:
        return []
    if not listen or listen.rstrip("/").endswith("/tcp/0"):
        raise Invalid("--announce needs --listen with a fixed port, e.g. --listen /ip4/0.0.0.0/tcp/31337: the "
                      "announced port must lead to the one the coordinator listens on")
    for addr in announce:
        if "/tcp/" not in addr or addr.rstrip("/").endswith("/tcp/0") or "/p2p/" in addr:
            raise Invalid(f"announce address {addr!r} must name a TCP port (not 0) and no /p2p/ part, "
                          "e.g. /dns4/swarm.example.org/tcp/31337")
    from hivemind.utils.multiaddr import Multiaddr  # hivemind's import takes seconds: after the checks above

    checked = []
    for addr in announce:
        try:
            checked.append(str(Multiaddr(addr)))
        except Exception as e:  # multiaddr raises several types for text it cannot read
            raise Invalid(f"announce address {addr!r} is not a multiaddr ({e})") from None
    return checked


def default_listen(previous: list[str], host: str) -> str:
    """Listen where the previous coordinator with this identity did, so workers' bootstrap addresses hold."""
    for addr in previous:
        parts = addr.split("/")
        if len(parts) > 4 and parts[3] == "tcp":
            return "/".join(parts[:5])
    return f"/ip4/{host}/tcp/0"
