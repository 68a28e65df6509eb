"""What an averager does as its peer leaves: its open rounds can be cancelled, and its process closes its P2P replica.

A leaving peer's optimizer waits for a state-averaging round still running in the background up to the averaging
timeout, though its partners are often leaving too (docs/hivemind.md#pitfalls, 18): ``RemembersRounds`` lets it
cancel that round instead. Each averager runs in a process of its own, talking to the DHT's p2pd through a replica of
its P2P client, which listens on a Unix socket of its own (``/tmp/hivemind-p2pclient-<id>.sock``). hivemind 1.1.12
never shuts that replica down: its socket file goes only in the replica's ``__del__``, which does not run as the
process exits, so every averager left one file in /tmp (pitfall 19); ``ClosesReplica`` closes it. hivemind's
shutdown of an averager with a round under way raised out of its process (pitfall 24); ``EndsRunningRounds`` does not.
"""

from __future__ import annotations

from typing import Any, List, Optional

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl


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


class EndsRunningRounds:
    """Mixin for a ``DecentralizedAverager`` subclass, listed before it: hivemind 1.1.12's ``_shutdown``, fixed.
    hivemind keeps each running round as a future of its all-reduce runner, calls ``finalize`` on that future and
    gathers what ``finalize`` returns (nothing), so an averager that shut down with a round under way raised
    ``AttributeError`` out of its process (pitfall 24). Here a round whose runner exists is finalized (cancelled, as
    hivemind means to) and one still waiting for its runner is cancelled."""

    async def _shutdown(self, timeout: Optional[float]) -> None:
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for runner in self._running_groups.values():
            if runner.done() and not runner.cancelled() and runner.exception() is None:
                runner.result().finalize(cancel=True)
            else:
                runner.cancel()


class RemembersRounds(DecentralizedAverager):
    """Base for a ``TrainingStateAverager`` subclass, listed after it: hivemind's state averager starts its rounds
    (``schedule_step``, and a delayed round in its background ``_do``) through ``DecentralizedAverager.step``, which
    this sits in front of, so a leaving peer can cancel a round still open (docs/hivemind.md#pitfalls, 18)."""

    def step(self, *args: Any, **kwargs: Any) -> Any:
        control = super().step(*args, **kwargs)
        if isinstance(control, StepControl):  # not when waited for: then the round is over
            self._open_rounds = [*self.open_rounds(), control]
        return control

    def open_rounds(self) -> List[StepControl]:
        """The rounds this averager started that have not ended yet."""
        return [control for control in getattr(self, "_open_rounds", []) if not control.done()]

    def cancel_open_rounds(self) -> int:
        """Cancel every round still open; how many there were."""
        rounds = self.open_rounds()
        for control in rounds:
            control.cancel()
        return len(rounds)
