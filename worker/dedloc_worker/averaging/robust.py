"""Robust aggregation: how an aggregator averages its parts when the run asks for CenteredClip.

hivemind's ``TensorPartReducer`` adds each sender's part into a running weighted sum as it arrives. CenteredClip
needs every sender's copy of a part first, so ``RobustPartReducer`` keeps the copies of the current part index
until each sender has sent it, or was banned for missing the round's timeout (hivemind's ``on_sender_failed``),
then aggregates them:

1. a sender's weight (the samples it says it accumulated) is capped at the run's samples-per-second ceiling times
   the time from the end of this aggregator's previous round (when the senders of a group start accumulating
   again; its start where they accumulate while a round runs) to the start of this one, plus a grace for peers
   whose previous round ended a little earlier (``RobustRule.weight_cap``; not in an aggregator's first round, which
   cannot know when the others began);
2. a part or weight that is not finite is dropped (the sender still receives the result);
3. the rest are averaged with ``averaging.centered_clip`` at a radius scaled to the part's size.

Each sender's treatment is tallied in an ``Attestation``, which the averager hands to its ``attest`` callback
once the round ends: it rides, signed, in the aggregator's metrics record (docs/averaging.md#robust-aggregation).
Under the plain mean ``TalliedPartReducer`` tallies the same way. The tallies are the aggregator's receipts: the
weight a sender's parts actually carried into the average (``Attestation.applied``) is what credit counts.
"""

from __future__ import annotations

import asyncio
import copy
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer

from dedloc_worker.averaging.centered_clip import centered_clip


@dataclass(frozen=True)
class RobustRule:
    """What an aggregator applies to the parts it averages.

    :param tau: CenteredClip's radius for the whole gradient vector (its norm units); a part of k of the vector's
      n elements is clipped at ``tau * sqrt(k / n)``, so the radius does not depend on how the vector is split
    :param iterations: CenteredClip iterations
    :param ceiling: the run's plausible samples per second per peer; None: weights are not capped
    :param grace: seconds added to the observed time before capping (peers of other groups may have ended their
      previous round up to a matchmaking time earlier)
    :param overlapped: senders go on accumulating while a round runs (delayed gradient averaging, overlapped outer
      rounds), so the cap's clock starts when the previous round began, not when it ended: from its end, an honest
      sender's weight was capped by the round's share of its phase (a swarm test's outer rounds took up to 38%)
    """

    tau: float
    iterations: int
    ceiling: Optional[float] = None
    grace: float = 0.0
    overlapped: bool = False

    def clock_start(self, previous_began: float, previous_ended: float) -> float:
        """When the senders of this round began accumulating, by the aggregator's previous round."""
        return previous_began if self.overlapped else previous_ended

    def weight_cap(self, elapsed: float) -> float:
        """The most samples a sender can have accumulated in ``elapsed`` seconds (inf without a ceiling)."""
        return math.inf if self.ceiling is None else self.ceiling * (max(elapsed, 0.0) + self.grace)


@dataclass
class Attestation:
    """How one aggregator treated one sender in one round: its receipt.

    :param parts: parts of the sender it aggregated; ``expected``: parts the sender was to send it (its share)
    :param weight: the weight the sender sent (samples; 0 if it was not finite); ``used``: after the cap
    :param dropped: parts dropped as not finite (robust aggregation); ``nonfinite``: parts holding a NaN or an
      infinity, dropped or not (the plain mean averages them in)
    :param zeros: finite parts that were all zeros
    :param clipped: parts whose offset from the centre was clipped
    :param kept: the smallest fraction of a clipped part's offset kept (1.0: none clipped)
    """

    parts: int = 0
    weight: float = 0.0
    used: float = 0.0
    dropped: int = 0
    clipped: int = 0
    kept: float = 1.0
    expected: int = 0
    nonfinite: int = 0
    zeros: int = 0

    def tally(self, part: torch.Tensor, weight: float, cap: float = math.inf) -> bool:
        """Count one part the sender sent with ``weight``; True when it is finite and carries weight."""
        self.parts += 1
        finite_weight = math.isfinite(weight)
        self.weight = max(self.weight, weight) if finite_weight else self.weight  # records stay JSON
        used = min(max(weight, 0.0), cap) if finite_weight else 0.0  # a negative weight carries none
        self.used = used if self.parts == 1 else min(self.used, used)
        if not finite_weight or not bool(torch.isfinite(part).all()):
            self.nonfinite += 1
            return False
        self.zeros += not bool(part.any())
        return used > 0

    @property
    def applied(self) -> float:
        """The weight (samples) the sender's parts carried into this aggregator's share: the used weight times the
        fraction of the expected parts that came and were finite; 0 when every finite part was zeros (a sender of
        zeros adds nothing; a few zero parts are honest: parameters that got no gradient)."""
        finite = self.parts - self.nonfinite
        if finite <= 0 or self.zeros >= finite:
            return 0.0
        return max(self.used, 0.0) * finite / max(self.expected, self.parts)

    @property
    def notable(self) -> bool:
        """Whether anything was cut or is missing: only these are published in full."""
        return self.nonfinite > 0 or self.dropped > 0 or self.clipped > 0 or self.applied < self.weight

    def as_record(self) -> dict:
        return {"parts": self.parts, "weight": float(self.weight), "used": float(self.used),
                "dropped": self.dropped, "clipped": self.clipped, "kept": round(float(self.kept), 6),
                "expected": self.expected, "nonfinite": self.nonfinite, "zeros": self.zeros}


class TalliedPartReducer(TensorPartReducer):
    """hivemind's ``TensorPartReducer`` (the plain weighted mean) that tallies each sender's parts in an
    ``Attestation``, as ``RobustPartReducer`` does, so receipts say what was averaged in under the mean too."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int):
        super().__init__(part_shapes, num_senders)
        self.attestations = [Attestation(expected=self.num_parts) for _ in range(num_senders)]

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        # Tallied before hivemind's wait for the part's turn (the round may end right after it), taken back if
        # the sender is banned meanwhile: a sender's parts come one at a time, so nothing else changed its tally.
        before = copy.copy(self.attestations[sender_index])
        if self.sender_failed_after[sender_index] == float("inf"):
            self.attestations[sender_index].tally(tensor_part, weight)
        try:
            return await super().accumulate_part(sender_index, part_index, tensor_part, weight)
        except BannedException:
            self.attestations[sender_index] = before
            raise


class RobustPartReducer(TensorPartReducer):
    """``TensorPartReducer`` that aggregates each part with ``RobustRule`` once all its senders' copies arrived.

    :param part_shapes: shapes of this aggregator's parts, in order
    :param num_senders: senders in the group
    :param rule: the cap and CenteredClip options
    :param weight_cap: the most weight (samples) any sender may carry this round
    :param total_elements: elements in the whole averaged vector (scales ``tau`` per part)
    """

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, *, rule: RobustRule,
                 weight_cap: float, total_elements: int):
        self.rule, self.weight_cap = rule, weight_cap
        self.total_elements = max(int(total_elements), 1)
        self._inputs: List[Tuple[int, torch.Tensor, float]] = []
        super().__init__(part_shapes, num_senders)
        self.attestations: List[Attestation] = [Attestation(expected=self.num_parts) for _ in range(num_senders)]

    def reset_accumulators(self):
        self._inputs = []
        super().reset_accumulators()

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        """hivemind 1.1.12's ``accumulate_part``, keeping the part instead of adding it to a sum."""
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self._inputs.append((sender_index, tensor_part, float(weight)))
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self):
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            try:
                self.current_part_future.set_result(self._aggregate(self._inputs))
            except Exception as e:  # every sender waiting on this part fails with it, none hangs
                self.current_part_future.set_exception(e)
            self.reset_accumulators()

    def _aggregate(self, inputs: List[Tuple[int, torch.Tensor, float]]) -> torch.Tensor:
        kept, weights = [], []
        for sender, part, weight in inputs:
            note = self.attestations[sender]
            nonfinite = note.nonfinite
            if note.tally(part, weight, self.weight_cap):
                kept.append((sender, part))
                weights.append(min(weight, self.weight_cap))
            note.dropped += note.nonfinite - nonfinite  # here every part that is not finite is dropped
        shape = self.part_shapes[self.current_part_index]
        if not kept:
            return torch.zeros(shape)  # nothing trustworthy carries weight: the mean of nothing, as hivemind's guard
        radius = self.rule.tau * math.sqrt(shape.numel() / self.total_elements)
        result = centered_clip(torch.stack([part for _, part in kept]), torch.tensor(weights, dtype=torch.float64),
                               radius, self.rule.iterations)
        for (sender, _), scale in zip(kept, result.scales.tolist()):
            if scale < 1.0:
                self.attestations[sender].clipped += 1
                self.attestations[sender].kept = min(self.attestations[sender].kept, scale)
        return result.centre.to(kept[0][1].dtype)


def notable_attestations(reducer: TensorPartReducer, sender_peer_ids: Sequence[str]) -> Dict[str, dict]:
    """PeerID -> what was cut from that sender in the round ``reducer`` aggregated (only senders cut at all)."""
    notes = getattr(reducer, "attestations", ())
    return {str(peer): note.as_record() for peer, note in zip(sender_peer_ids, notes) if note.notable}


def applied_weights(reducer: TensorPartReducer, sender_peer_ids: Sequence[str], own: str = "") -> Dict[str, float]:
    """PeerID -> the weight (samples) each sender's parts carried into the round ``reducer`` aggregated
    (``Attestation.applied``), for every sender but ``own`` that sent it at least one part: the receipts."""
    notes = getattr(reducer, "attestations", ())
    return {str(peer): float(note.applied) for peer, note in zip(sender_peer_ids, notes)
            if note.parts > 0 and str(peer) != own}


def replace_reducer(runner, reducer: TensorPartReducer) -> None:
    """Give ``runner`` (an ``AllReduceRunner``, before its round starts) ``reducer`` in place of the one hivemind
    built. The unused one is finished quietly: freed unfinished, it warns "received 0.0%"."""
    plain = runner.tensor_part_reducer
    plain.current_part_future.cancel()
    plain.finished.set()
    runner.tensor_part_reducer = reducer


STATE_WEIGHT = 1.0
"""The weight of a peer in a state round: hivemind's state averager sends 1 (0 to tag along while it leaves)."""


class StatePartReducer(RobustPartReducer):
    """``RobustPartReducer`` for state rounds, which average parameters (and any optimizer statistics the run
    averages): every sender's weight is capped at ``STATE_WEIGHT``, and a part that no finite copy weighs (a group
    whose members all tag along as they leave) is the CenteredClip of its finite copies at equal weights, not the
    zeros of a gradient round: zero parameters would reset the model.

    :param radius: CenteredClip's radius per element (parameter units): a part of k elements is clipped at
      ``radius * sqrt(k)``; ``rule.tau`` is ignored
    """

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, *, rule: RobustRule, radius: float):
        total = max(sum(shape.numel() for shape in part_shapes), 1)
        # RobustPartReducer clips a part of k elements at tau * sqrt(k / n): with n = k's sum here, tau per element
        super().__init__(part_shapes, num_senders, rule=RobustRule(tau=radius * math.sqrt(total),
                                                                   iterations=rule.iterations),
                         weight_cap=STATE_WEIGHT, total_elements=total)

    def _aggregate(self, inputs: List[Tuple[int, torch.Tensor, float]]) -> torch.Tensor:
        weighed = any(math.isfinite(weight) and weight > 0 and bool(torch.isfinite(part).all())
                      for _, part, weight in inputs)
        if not weighed:
            inputs = [(sender, part, STATE_WEIGHT) for sender, part, _ in inputs]
        return super()._aggregate(inputs)
