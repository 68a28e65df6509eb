"""Receipts: which senders' gradient parts this peer aggregated, in which all-reduce group, with what weight.

hivemind weights each sender's part by the samples it accumulated, and the aggregating peer sees that weight
and the round's group id. The aggregators run in a child process (the gradient averager); it appends one line
per part received, and one per round this peer itself joins, to a file in the worker's private folder. The main
process collects the lines when an epoch closes and publishes them, signed, with its metrics record, together
with the PeerIDs of the round's members (``members_of``). The coordinator credits a claim only when a member of
the same round that belongs to another user confirms its weight (app/credit/settlement.py). Groups, not epoch
numbers, tie claims to receipts: peers one epoch apart can share a round.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# The end of hivemind's handler name for gradient all-reduce parts ("<ClassName>.rpc_aggregate_part": our
# PlannedGradientAverager's name ends the same).
GRADIENT_PARTS = "GradientAverager.rpc_aggregate_part"
# Members of this many recent rounds are remembered for the records (a round is named once per epoch).
ROUNDS_REMEMBERED = 64


class ReceiptLog:
    def __init__(self, folder: Path):
        self.path = folder / "receipts.jsonl"
        self._offset = 0
        self._members: Dict[str, List[str]] = {}
        self._attested: Dict[str, Dict[str, dict]] = {}

    def note_part(self, group: bytes, sender_peer_id: str, weight: float) -> None:
        """A part received from ``sender_peer_id`` in round ``group`` (called in the averager's process)."""
        self._append({"group": group.hex(), "sender": sender_peer_id, "weight": float(weight)})

    def note_round(self, group: bytes, members: Sequence[str] = ()) -> None:
        """This peer joined round ``group``, whose members are ``members`` (PeerIDs, base58, this peer among them),
        with its own gradients (called in the averager's process)."""
        self._append({"group": group.hex(), "own": True, "members": [str(member) for member in members]})

    def note_attestation(self, group: bytes, notes: Dict[str, dict]) -> None:
        """What this peer, as an aggregator under robust aggregation, cut from senders in round ``group``:
        PeerID -> ``robust.Attestation.as_record()`` (called in the averager's process)."""
        self._append({"group": group.hex(), "attested": notes})

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
        """(the last round this peer joined, {group: {sender: weight}}) logged since the last drain."""
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
                self._attested.setdefault(entry["group"], {}).update(entry["attested"])
            elif entry.get("own"):
                own = entry["group"]
                self._members[own] = entry.get("members", [])
                while len(self._members) > ROUNDS_REMEMBERED:
                    self._members.pop(next(iter(self._members)))
            else:
                aggregated.setdefault(entry["group"], {})[entry["sender"]] = entry["weight"]
        return own, aggregated


def note_own_rounds(receipts: ReceiptLog) -> None:
    """Log every gradient all-reduce round this process (and its forks) joins. Call before forking."""
    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.optim.grad_averager import GradientAverager

    original = getattr(AllReduceRunner.__init__, "__wrapped__", AllReduceRunner.__init__)

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        servicer = kwargs.get("servicer_type")
        if isinstance(servicer, type) and issubclass(servicer, GradientAverager):  # the planned one too
            receipts.note_round(kwargs["group_id"], [str(peer) for peer in kwargs.get("ordered_peer_ids", ())])

    __init__.__wrapped__ = original
    AllReduceRunner.__init__ = __init__
