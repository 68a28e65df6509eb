"""Receipts: which senders' gradient parts this peer aggregated, in which all-reduce group, with what weight.

hivemind weights each sender's part by the samples it accumulated, and the aggregating peer sees that weight
and the round's group id. The aggregators run in a child process (the gradient averager): once a round ends its
reducer's tallies (``averaging.robust.Attestation``, one per sender, covering every part the sender sent) become one
line in a file in the worker's private folder: per sender the weight its parts actually carried into the average
(``Attestation.applied``: the weight after the run's cap, times the share of its parts that came and were finite; 0 for
a sender of zeros), and the full tally of every sender something was cut from or missing. Another line notes each round
this peer itself joins. The main process collects the lines when an epoch closes and publishes them, signed, with its
metrics record, together with the PeerIDs of the round's members (``members_of``). The coordinator credits a claim only
as far as a member of the same round that belongs to another user confirms it (app/credit/settlement.py). A part that
never reached the reducer (refused at the door, a group that never ran here) makes no receipt. Groups, not epoch
numbers, tie claims to receipts: peers one epoch apart can share a round.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# Members of this many recent rounds are remembered for the records (a round is named once per epoch).
ROUNDS_REMEMBERED = 64


class ReceiptLog:
    def __init__(self, folder: Path):
        self.path = folder / "receipts.jsonl"
        self._offset = 0
        self._members: Dict[str, List[str]] = {}
        self._attested: Dict[str, Dict[str, dict]] = {}
        self.own_weight: Optional[float] = None  # this peer's weight in the round the last drain returned

    def note_round(self, group: bytes, members: Sequence[str] = (), weight: Optional[float] = None) -> None:
        """This peer joined round ``group``, whose members are ``members`` (PeerIDs, base58, this peer among them),
        with its own gradients weighing ``weight`` samples (0: it tagged along, as a peer catching up with the swarm
        does; called in the averager's process)."""
        self._append({"group": group.hex(), "own": True, "members": [str(member) for member in members],
                      "weight": weight})

    def note_attestation(self, group: bytes, notes: Dict[str, dict],
                         applied: Optional[Dict[str, float]] = None) -> None:
        """What this peer, as an aggregator, did with senders' parts in round ``group`` (called in the averager's
        process once the round ends).

        :param notes: PeerID -> ``averaging.robust.Attestation.as_record()`` of each sender it cut something from
        :param applied: PeerID -> the weight (samples) each sender's parts carried into the average
          (``averaging.robust.applied_weights``), every sender that sent it a part
        """
        self._append({"group": group.hex(), "attested": notes, "applied": applied or {}})

    def take_attested(self) -> Dict[str, Dict[str, dict]]:
        """{group: {sender: attestation}} drained so far and not yet taken."""
        taken, self._attested = self._attested, {}
        return taken

    def members_of(self, group: str) -> List[str]:
        """The members of round ``group`` (hex) as this peer's averager formed it; [] when this peer did not join
        it or it was drained too long ago."""
        return list(self._members.get(group, ()))

    def _append(self, entry: dict) -> None:
        descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(descriptor, (json.dumps(entry) + "\n").encode())  # O_APPEND keeps lines whole
        finally:
            os.close(descriptor)

    def drain(self) -> Tuple[Optional[str], Dict[str, Dict[str, float]]]:
        """(the last round this peer joined, {group: {sender: weight}}) logged since the last drain. A round it joined
        with weight is preferred to a later one it tagged along in with none: its samples went into the former.
        ``own_weight`` is then the weight of the round returned (None where the log did not say)."""
        self.own_weight = None
        if not self.path.exists():
            return None, {}
        with open(self.path, "rb") as file:
            file.seek(self._offset)
            data = file.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        own, aggregated = None, {}
        for line in complete.splitlines():
            entry = json.loads(line)
            if "attested" in entry:
                if entry["attested"]:
                    self._attested.setdefault(entry["group"], {}).update(entry["attested"])
                if entry.get("applied"):
                    aggregated.setdefault(entry["group"], {}).update(entry["applied"])
            elif entry.get("own"):
                self._members[entry["group"]] = entry.get("members", [])
                while len(self._members) > ROUNDS_REMEMBERED:
                    self._members.pop(next(iter(self._members)))
                if own is None or entry.get("weight") != 0 or self.own_weight == 0:
                    own, self.own_weight = entry["group"], entry.get("weight")
        return own, aggregated


def note_own_rounds(receipts: ReceiptLog) -> None:
    """Log every gradient all-reduce round this process (and its forks) joins. Call before forking."""
    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.optim.grad_averager import GradientAverager

    from dedloc_worker.training.outer import OuterAverager

    original = getattr(AllReduceRunner.__init__, "__wrapped__", AllReduceRunner.__init__)

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        servicer = kwargs.get("servicer_type")
        # the planned gradient averager, and a local-updates run's outer averager (pseudo-gradient rounds)
        if isinstance(servicer, type) and issubclass(servicer, (GradientAverager, OuterAverager)):
            receipts.note_round(kwargs["group_id"], [str(peer) for peer in kwargs.get("ordered_peer_ids", ())],
                                weight=float(self.weight))

    __init__.__wrapped__ = original
    AllReduceRunner.__init__ = __init__
