"""Joining a run's swarm: the DHT node and the collaborative optimizer, with hivemind's pitfalls handled.

The pitfalls (docs/hivemind.md#pitfalls, same numbers) and where each is handled:
1. ``client_mode`` is passed to the Optimizer explicitly, always (``create_optimizer``).
2. Gradient-averager options go through ``grad_averager_factory``, not ``averager_opts`` (``create_optimizer``).
3. Child processes outliving a killed parent: the launcher ends the whole process group (``dedloc_worker.processes``).
4. Exceptions in the training loop: ``trainer.train`` shuts the optimizer and the DHT down in ``finally``.
5. Signed records need the validators registered on the reader too (``records.add_record_validators``).
6. A group whose senders all weigh 0 (an auxiliary peer and a trainer that just reloaded state) averages to NaN:
   ``averaging.guard_weightless_parts`` (``create_optimizer``).
7. Starting an averager sets SIGINT to "ignore" in the *calling* process (``run_in_background``), so Ctrl-C no
   longer stops the worker: ``create_optimizer`` puts the caller's handler back.
"""

from __future__ import annotations

import functools
import signal
from dataclasses import dataclass
from typing import List, Optional, Sequence

import hivemind

from dedloc_common.contract import GRADIENT_PART_BYTES, RunConfig


def create_dht(initial_peers: Sequence[str], listen: str, client_mode: bool, identity_path: Optional[str] = None,
               authorizer=None):
    """Start this process's DHT node (a child process plus its p2pd daemon) and wait until it is up.

    :param authorizer: checks every DHT request and response (``admission.RunAuthorizer``); None admits all
    """
    return hivemind.DHT(
        initial_peers=list(initial_peers),
        host_maddrs=[listen],
        client_mode=client_mode,
        identity_path=identity_path,
        authorizer=authorizer,
        start=True,
    )


async def reach_peers(_dht, node, addrs: Sequence[str]) -> int:
    """Run in the DHT process (``dht.run_coroutine``): connect to and ping each multiaddr (with /p2p/ID); how
    many answered. Both sides then hold each other in their routing tables, which a peer that was away for a
    while (a restarted coordinator) no longer is."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    reached = 0
    for addr in addrs:
        try:
            maddr = Multiaddr(addr)
            peer_id = PeerID.from_base58(maddr.value_for_protocol("p2p"))
            await node.p2p._client.connect(peer_id, [maddr])  # hivemind has no public call for this
            reached += await node.protocol.call_ping(peer_id) is not None
        except Exception:  # an address gone stale: the next one may answer
            continue
    return reached


@dataclass
class FinishedEpoch:
    """One collaboration step this peer took part in: the epoch it closed and the samples it averaged in."""

    epoch: int
    samples: int


class AccountedOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` that remembers how many local samples went into each global step.

    hivemind weights this peer's gradients by ``grad_averager.local_samples_accumulated`` when it averages, so
    that number, read as the epoch closes, is exactly this peer's contribution to the step. Samples discarded
    because the peer fell out of sync never reach it.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.finished_epochs: List[FinishedEpoch] = []

    def _update_global_epoch(self, grad_scaler) -> None:
        samples = self.grad_averager.local_samples_accumulated
        super()._update_global_epoch(grad_scaler)
        # The step leads to the collaboration's next epoch; a peer that lagged one behind jumps two, so the
        # step is named by where it leads (minus one), the same number on every peer that took part.
        self.finished_epochs.append(FinishedEpoch(self.local_epoch - 1, samples))


def create_optimizer(dht, config: RunConfig, params, client_mode: bool, aux: bool = False, verbose: bool = False):
    """The run's collaborative optimizer over ``params``, configured from the run config.

    :param aux: an auxiliary peer: it aggregates its share of every round and trains nothing
    """
    import torch

    from .averaging import PlannedGradientAverager, guard_weightless_parts

    guard_weightless_parts()

    opt = config.optimizer
    # hivemind warns (and can deadlock) when a request may outlive matchmaking; both averagers get this.
    averager_opts = dict(request_timeout=opt.matchmaking_time / 2)
    on_interrupt = signal.getsignal(signal.SIGINT)
    optimizer = AccountedOptimizer(
        dht=dht,
        run_id=config.run_id,
        params=params,
        optimizer=functools.partial(torch.optim.Adam, lr=opt.lr),
        target_batch_size=config.target_batch_size,
        batch_size_per_step=None if aux else config.batch_size,
        matchmaking_time=opt.matchmaking_time,
        averaging_timeout=opt.averaging_timeout,
        delay_optimizer_step=opt.delay_optimizer_step,
        delay_grad_averaging=opt.delay_grad_averaging,
        # Pitfall 1: a client-mode DHT with an implicit Optimizer client_mode crashes at the first epoch.
        client_mode=client_mode,
        auxiliary=aux,
        # Pitfall 2: averager_opts reach only the state averager; the gradient averager gets them here, and it is
        # the one that applies the coordinator's averaging plan.
        grad_averager_factory=functools.partial(PlannedGradientAverager, part_size_bytes=GRADIENT_PART_BYTES,
                                                **averager_opts),
        averager_opts=averager_opts,
        tracker_opts=dict(metadata_expiration=opt.metadata_expiration),
        verbose=verbose,
    )
    signal.signal(signal.SIGINT, on_interrupt)  # pitfall 7
    return optimizer
