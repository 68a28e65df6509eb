"""Every replacement of a hivemind 1.1.12 internal, listed in one place with what it answers.

The functions live with the concern they serve; ``install`` puts them in place, before any hivemind process forks
from this one (each is idempotent). Two replacements happen inside the DHT's own process and are made by
``swarm.node.SwarmDHT.run``, listed here too. Numbers are docs/hivemind.md#pitfalls'.
"""

from __future__ import annotations

from typing import NamedTuple


class Replacement(NamedTuple):
    target: str  # what in hivemind is replaced
    by: str  # where dedloc's version lives, under dedloc_worker
    answers: str


REPLACEMENTS = (
    Replacement("P2P.add_protobuf_handler", "admission.gate.guard_handlers",
                "every RPC but the DHT's refuses a caller without a valid token (docs/hivemind.md#authorization)"),
    Replacement("AllReduceRunner.__init__", "credit.receipts.note_own_rounds",
                "receipts: each gradient round this peer joins is logged with its group and members"),
    Replacement("TensorPartReducer.check_current_part_finished", "averaging.planned.guard_weightless_parts",
                "pitfall 6: a part whose senders all weigh 0 averages to NaN"),
    Replacement("hivemind.averaging.averager.Matchmaking", "averaging.matchmaking.pace_matchmaking",
                "pitfall 11: matchmaking reads the group key back to back while it waits"),
    Replacement("hivemind.optim.optimizer.TrainingStateAverager", "averaging.state_sharing.declare_state_on_change",
                "state declared on a period and on a change, robust state rounds, checked downloads"),
    Replacement("Quantization.extract", "averaging.quantization.readable_quantization",
                "pitfall 29: under NumPy 2.4 no uint8 part could be read, and uint8 rounds averaged nothing"),
    Replacement("RSAPrivateKey._process_wide_key", "admission.identity.persistent_key",
                "one key per worker: its libp2p identity, its peer token's key, its records' signer"),
    Replacement("hivemind.dht.dht.DHTNode (DHT process)", "swarm.node.SwarmDHT.run",
                "pitfall 25: a store repeats the lookup it has just made"),
    Replacement("DHT._inner_pipe (DHT process)", "swarm.node.SwarmDHT.run",
                "pitfall 14: a request whose sender has left stops the DHT's process"),
)


def install(admission=None, receipts=None) -> None:
    """Put the replacements in place in this process (and the processes it forks from now on).

    :param admission: the ``admission.gate.AdmissionState`` every guarded RPC checks (None: no gate installed)
    :param receipts: the ``credit.receipts.ReceiptLog`` rounds are noted in (None: no round is noted)
    """
    from dedloc_worker.averaging.matchmaking import pace_matchmaking
    from dedloc_worker.averaging.planned import guard_weightless_parts
    from dedloc_worker.averaging.quantization import readable_quantization
    from dedloc_worker.averaging.state_sharing import declare_state_on_change

    if admission is not None:
        from dedloc_worker.admission.gate import guard_handlers

        guard_handlers(admission)
    if receipts is not None:
        from dedloc_worker.credit.receipts import note_own_rounds

        note_own_rounds(receipts)
    guard_weightless_parts()
    readable_quantization()
    pace_matchmaking()
    declare_state_on_change()


def installed() -> list[str]:
    """The targets of ``REPLACEMENTS[:5]`` whose replacement is in place in this process now."""
    import hivemind.averaging.averager as averager
    import hivemind.optim.optimizer as optimizer
    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.averaging.partition import TensorPartReducer
    from hivemind.p2p import P2P

    found = []
    if hasattr(P2P.add_protobuf_handler, "__wrapped__"):
        found.append(REPLACEMENTS[0].target)
    if hasattr(AllReduceRunner.__init__, "__wrapped__"):
        found.append(REPLACEMENTS[1].target)
    if hasattr(TensorPartReducer.check_current_part_finished, "__wrapped__"):
        found.append(REPLACEMENTS[2].target)
    if averager.Matchmaking.__module__.startswith("dedloc_worker"):
        found.append(REPLACEMENTS[3].target)
    if optimizer.TrainingStateAverager.__module__.startswith("dedloc_worker"):
        found.append(REPLACEMENTS[4].target)
    return found
