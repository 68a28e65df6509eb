"""dedloc-worker, writing down every gradient all-reduce it takes part in, for a test to check the arithmetic.

    python tests/support/actors/witness.py FOLDER <dedloc-worker arguments>

For each round, FOLDER/<group>-<peer>.pt holds this peer's vector before and after the all-reduce, the weight it
averaged with, whether every part came and went (hivemind now and then loses one; the parts of members left out of the
round are refused, not missing), the group's members, the fractions of the vector each aggregated (the plan's split,
or hivemind's) and the members left out (``RoundOutcome.left_out``: PeerID -> why; {} before that existed). The code
under test is unchanged: the record is taken around hivemind's own all-reduce call.
"""

import sys
from pathlib import Path

import torch
from dedloc_worker import cli
from dedloc_worker.averaging import planned as averaging

folder = Path(sys.argv.pop(1))
folder.mkdir(parents=True, exist_ok=True)
run_allreduce = averaging.PlannedGradientAverager._run_allreduce_inplace_


async def witnessed(self, tensors, group_info, group_id=None, **kwargs):
    before = [tensor.detach().clone() for tensor in tensors]
    await run_allreduce(self, tensors, group_info, group_id, **kwargs)
    group_bytes = group_id or group_info.group_id
    group = group_bytes.hex()
    runner = self._running_groups[group_bytes].result()  # set when the all-reduce began
    reducer = runner.tensor_part_reducer
    left_out = dict(getattr(self._last_round, "left_out", None) or {})  # its parts refused from the start
    senders = [index for index, peer in enumerate(runner.sender_peer_ids) if str(peer) not in left_out]
    complete = runner.tensor_part_container.failed_size == 0 and (
        not reducer.num_parts or all(reducer.num_parts_received[index] == reducer.num_parts for index in senders))
    record = dict(
        complete=bool(complete),
        group=group, me=str(self.peer_id), peers=[str(peer) for peer in group_info.peer_ids],
        weight=kwargs.get("weight"), fractions=list(kwargs.get("peer_fractions") or []),
        planned=bool(self._last_round and self._last_round.planned), left_out=left_out,
        before=before, after=[tensor.detach().clone() for tensor in tensors],
    )
    torch.save(record, folder / f"{group}-{self.peer_id}.pt")


averaging.PlannedGradientAverager._run_allreduce_inplace_ = witnessed
cli.main(sys.argv[1:])
