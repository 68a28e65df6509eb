"""An averager's process closes its replica of the DHT's P2P client as the averager shuts down.

Each averager runs in a process of its own, talking to the DHT's p2pd through a replica of its P2P client, which
listens on a Unix socket of its own (``/tmp/hivemind-p2pclient-<id>.sock``). hivemind 1.1.12 never shuts that
replica down: its socket file goes only in the replica's ``__del__``, which does not run as the process exits, so
every averager left one file in /tmp (docs/hivemind.md#pitfalls, 19).
"""

from __future__ import annotations

from typing import Optional


class ClosesReplica:
    """Mixin for a ``DecentralizedAverager`` subclass, listed before it: its ``_shutdown``, in the averager's
    process, ends by closing the replica, which removes the replica's socket file."""

    async def _shutdown(self, timeout: Optional[float]) -> None:
        try:
            await super()._shutdown(timeout)
        finally:
            replica = getattr(self, "_p2p", None)  # absent when the averager failed to start
            if replica is not None:
                await replica.shutdown()
