"""A state averager that can also download one named peer's state, leaving its own as it is.

hivemind's ``load_state_from_peers`` asks the peer of highest priority (ties broken at random) and loads what it gets
into the averager. The spot checker needs the state of the very peer it checks, the parameters that peer computed on
(another peer's can have drifted after a round it missed), without touching the checkpointer's copy.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from dedloc_worker.averaging.state_sharing import ChecksDownloads
from dedloc_worker.swarm.leaving import ClosesReplica
from dedloc_worker.training.outer import PseudoGradientAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import PeerID
from hivemind.utils import MPFuture


class OuterStateAverager(ClosesReplica, PseudoGradientAverager):
    """The checkpointer's averager in a local-updates run: downloads the outer parameters and the outer optimizer's
    momentum the peers serve (``training.outer.PseudoGradientAverager.load_state_from_peers``), into the model."""

    @classmethod
    def get_stub(cls, p2p, peer, *, namespace=None):
        return TrainingStateAverager.get_stub(p2p, peer, namespace=namespace)


class PeerStateAverager(ClosesReplica, TrainingStateAverager, ChecksDownloads):
    """The checkpointer's averager: loads only a whole download (``ChecksDownloads``), and downloads one named peer's
    state on request."""

    @classmethod
    def get_stub(cls, p2p, peer, *, namespace=None):
        # handler names carry the servicer's class name: the workers serve as hivemind's TrainingStateAverager
        return TrainingStateAverager.get_stub(p2p, peer, namespace=namespace)

    def download_from(self, peer_id: str, timeout: float) -> Optional[Tuple[dict, Sequence[torch.Tensor]]]:
        """(metadata, tensors) as ``peer_id`` serves its state (``get_current_state``'s order), or None when it
        serves none; raises what the transfer raised. ``timeout`` bounds the wait between two parts."""
        future = MPFuture()
        self._outer_pipe.send(("_download_named", [], dict(peer_id=peer_id, timeout=timeout, future=future)))
        return future.result(timeout=timeout * 10)

    async def _download_named(self, peer_id: str, timeout: float, future: MPFuture) -> None:
        # not ``_download_from``: that name is ``ChecksDownloads``'s, which its own downloads call
        try:
            metadata, tensors = await self._download_from(PeerID.from_base58(peer_id), timeout)
            future.set_result((metadata, tensors) if metadata else None)
        except Exception as e:
            future.set_exception(e)
