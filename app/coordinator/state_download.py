"""A state averager that can also download one named peer's state, leaving its own as it is.

hivemind's ``load_state_from_peers`` asks the peer of highest priority (ties broken at random) and loads what it gets
into the averager. The spot checker needs the state of the very peer it checks, the parameters that peer computed on
(another peer's can have drifted after a round it missed), without touching the checkpointer's copy.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming

from dedloc_worker.leaving import ClosesReplica
from dedloc_worker.state_sharing import ChecksDownloads


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
        self._outer_pipe.send(("_download_from", [], dict(peer_id=peer_id, timeout=timeout, future=future)))
        return future.result(timeout=timeout * 10)

    async def _download_from(self, peer_id: str, timeout: float, future: MPFuture) -> None:
        try:  # the loop of hivemind 1.1.12's _load_state_from_peers, for one peer
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            metadata, parts, tensors = None, [], []
            async for message in aiter_with_timeout(stream, timeout=timeout):
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:  # a dtype starts the next tensor
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
            if parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            future.set_result((metadata, tensors) if metadata else None)
        except Exception as e:
            future.set_exception(e)
