"""Outer rounds of local-updates training (DiLoCo, Douillard et al. 2023, arXiv 2311.08105).

Each peer takes inner optimizer steps on its own data from the shared *outer* parameters. At an outer round the
peers average their pseudo-gradients (outer parameters minus their local ones), weighted by the samples each trained
since the last round, and every peer applies the same outer step (SGD with Nesterov momentum) to the same outer
parameters, then trains on from them.

``PseudoGradientAverager`` does this inside hivemind's ``TrainingStateAverager``: the state round averages the
pseudo-gradient in place of the parameters (so the run's compression and robust reduction apply to the small
deltas, not to the weights), the averaged result goes through ``OuterOptimizer``, and a peer that loads state gets
the outer parameters and the outer momentum, never another peer's drifting local ones.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Optional, Sequence

import torch
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_logger
from hivemind.utils.timed_storage import ValueWithExpiration

from dedloc_worker.averaging.planned import PlannedAverager
from dedloc_worker.averaging.state_sharing import read_state_stream
from dedloc_worker.swarm.leaving import RemembersRounds

logger = get_logger(__name__)

LINEAGE_BYTES = 8  # an outer state's lineage: a hash of the rounds that made it (``lineage_after``)
SOURCES_ASKED = 3  # peers a state download asks, by declared priority, for a newer outer state
OUTER_LR = 0.7  # DiLoCo's outer learning rate and Nesterov momentum (section 3 of the paper)
OUTER_MOMENTUM = 0.9


class OuterOptimizer:
    """Nesterov SGD over a copy of the parameters that only outer rounds move.

    :param params: the model's parameters; their values now are the first outer parameters
    :param lr: outer learning rate (1.0 without momentum is plain parameter averaging)
    :param momentum: Nesterov momentum
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = OUTER_LR, momentum: float = OUTER_MOMENTUM):
        if not lr > 0:
            raise ValueError(f"the outer learning rate must be positive, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"the outer momentum must be in [0, 1), got {momentum}")
        self.params = [p.detach().to("cpu", torch.float32, copy=True) for p in params]
        # torch's SGD with nesterov=True is the outer step DiLoCo uses, with the pseudo-gradient as the gradient
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    @torch.no_grad()
    def pseudo_gradients(self, local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Outer parameters minus ``local`` ones: where this peer's inner steps moved since the last round, negated."""
        return [outer - p.detach().to("cpu", torch.float32) for outer, p in zip(self.params, local)]

    @torch.no_grad()
    def step(self, averaged: Sequence[torch.Tensor], local: Sequence[torch.Tensor],
             sent: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Apply the swarm's averaged pseudo-gradient to the outer parameters and restart ``local`` from them.

        :param sent: where the round overlapped later inner steps, the pseudo-gradient this peer sent (its local
          parameters then were the outer ones minus it): those later steps are kept, on top of the new outer
          parameters, as delayed parameter updates keep a step's gradients (buffers reused)
        """
        if sent is not None:
            for delta, outer in zip(sent, self.params):
                delta.sub_(outer)  # minus the local parameters the round began from
        for outer, delta in zip(self.params, averaged):
            outer.grad = delta.to(torch.float32).clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if sent is None:
            self.restart(local)
            return
        for p, outer, began in zip(local, self.params, sent):
            p.add_((began + outer).to(p.device, p.dtype))  # local - began_from + outer: its later drift, moved

    @torch.no_grad()
    def restart(self, local: Sequence[torch.Tensor]) -> None:
        """Set ``local`` parameters to the outer ones (a round that failed here, or a state just loaded)."""
        for p, outer in zip(local, self.params):
            p.copy_(outer.to(p.device, p.dtype))

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The outer optimizer's momentum, one tensor per parameter (zeros before the first round)."""
        return [self.optimizer.state.get(p, {}).get("momentum_buffer", torch.zeros_like(p)) for p in self.params]

    @torch.no_grad()
    def load(self, params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor]) -> None:
        """Take another peer's (or a checkpoint's) outer parameters and momentum."""
        if len(params) != len(self.params) or len(momentum) != len(self.params):
            raise ValueError("the outer state names other parameters than this model's")
        for mine, theirs, buffer in zip(self.params, params, momentum):
            mine.copy_(theirs)
            self.optimizer.state[mine]["momentum_buffer"] = buffer.to(torch.float32).clone()


def lineage_after(lineage: str, epoch: int, members: Iterable[Any]) -> str:
    """The lineage of the outer state that the round of ``members`` (peer IDs; this peer alone for a step alone)
    made from a state of ``lineage`` at ``epoch``: every member of a round that averaged computes the same one, while
    fp16 rounding leaves their parameters a little apart, so it tells two states of one epoch made by different
    rounds apart where the parameters cannot."""
    text = f"{lineage}|{epoch}|{','.join(sorted(map(str, members)))}"
    return hashlib.blake2b(text.encode(), digest_size=LINEAGE_BYTES).hexdigest()


def prevailing(bases: Sequence[tuple[int, Optional[str]]], epoch: int) -> Optional[str]:
    """Of the lineages a round's members averaged from at ``epoch``, the one most of them hold (ties: the least
    string, so that every member picks the same one); None where no member said."""
    counts: dict[str, int] = {}
    for base_epoch, lineage in bases:
        if base_epoch == epoch and lineage is not None:
            counts[lineage] = counts.get(lineage, 0) + 1
    return min(counts, key=lambda lineage: (-counts[lineage], lineage)) if counts else None


def parse_base(gathered: Any) -> Optional[tuple[int, Optional[str]]]:
    """A member's gathered base: (outer epoch, lineage), or (epoch, None) from a worker that sends the epoch alone."""
    if isinstance(gathered, int) and not isinstance(gathered, bool):
        return gathered, None
    if isinstance(gathered, (list, tuple)) and len(gathered) == 2 and isinstance(gathered[0], int) \
            and isinstance(gathered[1], str):
        return gathered[0], gathered[1]
    return None


class PseudoGradientAverager(TrainingStateAverager):
    """hivemind's state averager whose rounds are DiLoCo's outer rounds (see the module doc).

    Same arguments as ``TrainingStateAverager`` (``offload_optimizer`` and ``reuse_tensors`` off: the averaged
    tensors are buffers of their own), and:

    :param outer_lr: outer learning rate
    :param outer_momentum: outer Nesterov momentum
    :param overlap: a round runs in the background while this peer trains on (``Optimizer(delay_state_averaging=
      True)``); its result is applied to the outer parameters when it ends, and the inner steps taken meanwhile are
      kept on top of them (``OuterOptimizer.step``'s ``sent``)
    :ivar samples: samples this peer trained since the last outer round: its weight in the next one (the caller adds
      to it; a round, failed or not, starts it again from 0)
    :ivar rounds: outer rounds this peer applied
    :ivar outer_epoch: the epoch its outer parameters are of: the one served as the state's epoch, and the base each
      round gathers. hivemind advances ``local_epoch`` before a round and after a state load may jump it to the
      swarm's; a peer whose base is behind its round's would add the same average to older outer parameters and
      part from the swarm for good, so it takes the newest state instead (``stale``)
    :ivar lineage: which rounds made the outer parameters (``lineage_after``). Two peers can reach one epoch by
      different rounds: a joiner that saw no other peer yet steps alone while the others average. Members gather
      their lineage with their epoch; where it differs, the peers off the lineage most members hold take the newest
      state instead of stepping (``forked``), as a stale peer does, or the two would average from different outer
      parameters for good
    :ivar missed: the last round failed here or averaged from an older base (``missed_rounds``: how many did)
    """

    def __init__(self, *, outer_lr: float = OUTER_LR, outer_momentum: float = OUTER_MOMENTUM, overlap: bool = False,
                 **kwargs: Any):
        kwargs.update(offload_optimizer=False, reuse_tensors=False, delta_rule_averaging=False)
        # The outer state is served from a thread of this process while the training thread may be stepping it:
        # a download must see one round's parameters and momentum, not half of the next
        self.outer_lock = threading.Lock()
        if kwargs.get("average_opt_statistics") or kwargs.get("extra_tensors"):
            raise ValueError("outer rounds average the pseudo-gradient only")
        super().__init__(**kwargs)
        self.overlap = overlap
        if overlap:  # inner steps go through this executor too: one worker would queue them behind the round
            self.step_executor.shutdown(wait=False)
            self.step_executor = ThreadPoolExecutor(max_workers=2)
        self._sent: Optional[list[torch.Tensor]] = None  # the pseudo-gradient of the round running
        self._round_overlapped = False  # the round running runs in the background
        self.outer = OuterOptimizer(self.main_parameters, lr=outer_lr, momentum=outer_momentum)
        self.samples = 0
        self.rounds = 0
        self.attempts = 0  # outer rounds begun with other peers
        self.outer_epoch = self.local_epoch
        self.lineage = ""
        self.forked = 0  # rounds in which this peer found itself off its members' lineage
        self.off_lineage = False  # the last round's did
        self.stale = False  # the last round's members averaged from newer outer parameters than this peer's
        self.missed_rounds = 0
        self.loads = 0  # outer states loaded from peers
        self.missed = False  # the last round failed here: this peer's outer parameters are behind its peers'
        self._round_weight: Optional[float] = None
        self._round_control: Any = None
        self._round_base = self._scheduled_base = self.outer_epoch

    @property
    def last_weight(self) -> float:
        """The weight (samples) this peer's last round was joined with."""
        return self._round_weight or 0.0

    def step(self, *args: Any, averaging_round: bool = False, averaging_opts: Optional[dict] = None,
             averaging_control: Any = None, **kwargs: Any):
        if averaging_round:
            # Weighted by samples, so a fast GPU's phase counts for what it computed. hivemind passes the weight of a
            # round it made itself only: a round scheduled ahead gets it on its control. The control is kept, so that
            # ``_apply_averaging_results_`` can tell a round that averaged from one that failed.
            weight = float(max(self.samples, 0))
            opts = dict(averaging_opts or {})
            ahead = averaging_control is not None and not averaging_control.triggered \
                and not averaging_control.done() and self._scheduled_base == self.outer_epoch
            if ahead:
                averaging_control.weight = weight  # its matchmaking began ahead (``schedule_round``), from this base
            else:
                if averaging_control is not None and not averaging_control.done():
                    averaging_control.cancel()  # failed, or scheduled from outer parameters this peer no longer has
                averaging_control = self._begin_round(weight=weight, timeout=opts.pop("timeout", None),
                                                      **{k: v for k, v in opts.items() if k != "weight"})
            self._round_base = self.outer_epoch
            self._round_overlapped = self.overlap and bool(kwargs.get("delay_averaging"))
            # taken here, in the training thread: the round copies it in the background, where an overlapped
            # round's local parameters are already moving on
            self._sent = self.outer.pseudo_gradients(self.main_parameters)
            self.attempts += 1
            averaging_opts = None  # the control is made: hivemind would warn of options it no longer uses
            self._round_control, self._round_weight, self.samples = averaging_control, weight, 0
        return super().step(*args, averaging_round=averaging_round, averaging_opts=averaging_opts,
                            averaging_control=averaging_control, **kwargs)

    def _begin_round(self, **kwargs: Any):
        """A round's control: past TrainingStateAverager's step, as its own round-making does (a planned averager
        announces); the members gather their bases, so each can tell whether it averaged from the same outer
        parameters."""
        return super(TrainingStateAverager, self).step(gather=[self.outer_epoch, self.lineage], require_trigger=True,
                                                       wait=False,
                                                       **kwargs)

    def schedule_round(self, scheduled_time: float, timeout: Optional[float] = None):
        """Begin the next round's matchmaking now, for a group formed by ``scheduled_time`` (DHT time), as hivemind
        schedules gradient rounds ahead; ``step`` then uses it if this peer still steps from the same outer
        parameters."""
        self._scheduled_base = self.outer_epoch
        return self._begin_round(scheduled_time=scheduled_time, timeout=timeout)

    @torch.no_grad()
    def _load_local_tensors_into_averager_(self) -> None:
        with self.get_tensors() as averaged:
            for buffer, delta in zip(averaged, self._sent):
                buffer.copy_(delta)

    @torch.no_grad()
    def _apply_averaging_results_(self) -> None:
        control, self._round_control = self._round_control, None
        sent, self._sent = self._sent, None
        if self._round_base != self.outer_epoch:
            return  # a state was loaded while the round ran in the background: it is newer than the round's base
        if control is None or not control.done() or control.cancelled() or control.exception() is not None:
            # hivemind calls this after a failed round too, its buffers holding this peer's own pseudo-gradient:
            # the outer parameters stay, and the caller takes the next outer state from the peers that averaged
            self.missed_rounds += 1
            self.missed = True
            return
        gathered = control.result()
        bases = [base for base in map(parse_base, gathered.values()) if base is not None]
        if max((epoch for epoch, _ in bases), default=self._round_base) > self._round_base:
            # the others stepped from newer outer parameters: the same step here would leave this peer behind
            self.missed_rounds += 1
            self.missed = self.stale = True
            return
        lineage = prevailing(bases, self._round_base)
        if lineage is not None and lineage != self.lineage:
            # same epoch, other rounds made it: the peers of the prevailing lineage step, this one takes their state
            self.missed_rounds += 1
            self.forked += 1
            self.missed = self.stale = self.off_lineage = True
            return
        if not self._round_complete():
            # an aggregator left mid-round: hivemind keeps this peer's own values for its parts, so a step here
            # would part it from peers that got those parts. It takes their state, or, where nobody got them, all
            # keep the outer parameters they share and train on
            self.missed_rounds += 1
            self.missed = True
            return
        self._step_outer(sent if self._round_overlapped else None, members=gathered.keys())

    def _round_complete(self) -> bool:
        """Whether every part of the last round came back averaged."""
        return True

    @torch.no_grad()
    def step_alone(self) -> None:
        """An outer round with no other peer in the swarm (hivemind then makes none): DiLoCo with one worker, the outer
        step takes this peer's own pseudo-gradient, so the outer parameters and their epoch move on while it is
        alone and a peer that joins takes where it got to."""
        self._round_base, self._round_weight, self.samples = self.outer_epoch, float(max(self.samples, 0)), 0
        self._sent = self.outer.pseudo_gradients(self.main_parameters)
        with self.lock_averaging:
            self._load_local_tensors_into_averager_()
            self._sent = None
            self._step_outer(members=[self.peer_id])

    def _step_outer(self, sent: Optional[list[torch.Tensor]] = None, *, members: Iterable[Any]) -> None:
        """The outer step from the averaging buffers, by the round of ``members``; ``sent``: see
        ``OuterOptimizer.step``."""
        with self.get_tensors() as averaged, self.outer_lock:
            self.outer.step([tensor.clone() for tensor in averaged], self.main_parameters, sent=sent)
            self.rounds += 1
            self.lineage = lineage_after(self.lineage, self._round_base, members)
            self.outer_epoch = self._round_base + 1
        self.local_epoch = max(self.local_epoch, self.outer_epoch)
        self.missed = self.stale = self.off_lineage = False

    def get_current_state(self):
        """The outer state, as ``TrainingStateAverager.get_current_state`` lays a state out: outer parameters, then
        the outer momentum as extra tensors (the inner optimizer's statistics are each peer's own)."""
        with self.outer_lock:
            metadata, tensors, infos = super().get_current_state()
            rounds, epoch, lineage = self.rounds, self.outer_epoch, self.lineage
            outer_tensors = [p.clone() for p in self.outer.params] + [m.clone() for m in self.outer.momentum_buffers()]
        count = len(self.outer.params)
        outer_infos = list(infos[:count]) + [type(info).from_tensor(m, key=f"outer_momentum.{i}", role=info.role)
                                            for i, (m, info) in enumerate(zip(outer_tensors[count:], infos[:count]))]
        # the epoch of the outer parameters, not local_epoch: mid-round that is already the next one
        metadata = dict(metadata, epoch=epoch, outer_rounds=rounds, lineage=lineage, optimizer_metadata=None)
        return metadata, outer_tensors, outer_infos

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None):
        """Take the newest outer state a peer serves, if it is newer than this peer's, and restart the local
        parameters from it."""
        future = MPFuture()
        self._outer_pipe.send(("_download_newer", [], dict(newer_than=self.outer_epoch, timeout=timeout,
                                                           future=future)))
        loaded = future.result()
        if loaded is None:
            logger.log(self.status_loglevel, "the swarm's newest outer state is no newer than this peer's")
            return None
        metadata, tensors = loaded
        count = len(self.outer.params)
        if len(tensors) != 2 * count:
            logger.warning(f"not loading an outer state of {len(tensors)} tensors; this model has {count} parameters")
            return None
        with self.outer_lock:
            self.outer.load(tensors[:count], tensors[count:])
            self.outer.restart(self.main_parameters)
            self.outer_epoch = metadata["epoch"]
            self.lineage = str(metadata.get("lineage", ""))
        self.rounds, self.samples = int(metadata.get("outer_rounds", self.rounds)), 0
        self.missed = self.stale = self.off_lineage = False
        self.loads += 1
        self.local_epoch = max(self.local_epoch, metadata["epoch"])
        self._update_scheduler()
        return True


    async def _download_newer(self, future: MPFuture, newer_than: int, timeout: Optional[float] = None) -> None:
        """In the averager's process: the outer state of the first peer, by the priority they declare (their outer
        epoch, at most ``PRIORITY_SPACING`` stale), whose state is of an epoch after ``newer_than``: (metadata,
        tensors), or None. A peer's metadata comes first in its stream, so a state no newer is dropped there: a
        peer that missed a round asks again a second later, and a whole download to learn that no peer had a newer
        state took seconds on a slow link, long enough to miss the next round too (bench/results/local_updates.md)."""
        timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        try:
            key_manager = self._matchmaking.group_key_manager
            declared, _ = self.dht.get(f"{key_manager.prefix}.all_averagers", latest=True) or ({}, None)
            priority = {PeerID(peer): (float(info.value), random.random()) for peer, info in
                        (declared.items() if isinstance(declared, dict) else ())
                        if isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int))}
            for peer in sorted(priority, key=priority.get, reverse=True)[:SOURCES_ASKED + 1]:
                if peer == self.peer_id:
                    continue
                try:
                    found = await self._download_if_newer(peer, newer_than, timeout)
                except Exception as e:
                    logger.warning(f"could not download the outer state from peer {peer}: {e!r}")
                    continue
                if found is not None and not all(torch.isfinite(tensor).all() for tensor in found[1]):
                    logger.warning(f"refused the outer state of peer {peer}: it is not finite; asking another")
                elif found is not None:
                    future.set_result(found)
                    return
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_if_newer(self, peer: PeerID, newer_than: int, timeout: Optional[float]):
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        # bounded: a peer killed a moment ago can leave its libp2p daemon answering for it, and a stream opened there
        # never yields (a worker waited on one for minutes)
        stream = await asyncio.wait_for(stub.rpc_download_state(averaging_pb2.DownloadRequest()), timeout)
        metadata, tensors = await read_state_stream(stream, self.serializer, timeout, keep=lambda found: isinstance(
            found, dict) and isinstance(found.get("epoch"), int) and found["epoch"] > newer_than)
        return (metadata, tensors) if metadata is not None else None


class OuterAverager(PseudoGradientAverager, PlannedAverager, RemembersRounds):
    """The outer rounds of a local-updates run, as a gradient round runs in a large-batch one: the coordinator's
    plan splits the pseudo-gradient vector (``set_plan``), members check each other's announced shares, each
    aggregator averages its part with the run's robust rule (CenteredClip on pseudo-gradients) and notes what every
    sender's part carried in (``attest``: the receipts the coordinator credits the inner samples from).

    Same arguments as ``PseudoGradientAverager`` and ``averaging.planned.PlannedAverager``. Its RPC handlers carry
    hivemind's ``TrainingStateAverager`` names, so the checkpointer and joining peers download the outer state from it
    as from any state averager.
    """

    @classmethod
    def _get_handle_name(cls, namespace, method_name: str) -> str:
        return TrainingStateAverager._get_handle_name(namespace, method_name)

    def _round_complete(self) -> bool:
        outcome = self.last_round(timeout=30)
        return outcome is None or outcome.failed_elements == 0
