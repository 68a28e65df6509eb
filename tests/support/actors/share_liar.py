"""A worker patched to announce a share of the vector its plan does not give it, as a cheater would patch dedloc-worker.

    python tests/support/actors/share_liar.py FOLDER <dedloc-worker arguments>
    python tests/support/actors/share_liar.py FOLDER tests/support/actors/witness.py FOLDER <dedloc-worker arguments>
        (witnessed)

In its rounds under a plan that gives it a share it first announces 1e9 and returns every part it aggregates in
those rounds off by LIE_OFFSET (with the whole vector, it would falsify its group's average); once that lie has met
a group of more than itself, it announces 0 instead (planned to aggregate, it would aggregate nothing); once that one
has too, its own share. FOLDER/share-lies.jsonl gets one line per round a lie met a group: {"group" (hex), "share",
"members"}. The code it patches is the same before and after announced shares were checked (hivemind's own step and
reducer), so that a test of the check fails on the code before it.
"""

import json
import sys
from pathlib import Path

from chain import go_on
from dedloc_worker.averaging import planned as averaging
from dedloc_worker.averaging.announcements import PLAN_MARKER
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.partition import TensorPartReducer

LIES = (1e9, 0.0)
LIE_OFFSET = 1.0
folder = Path(sys.argv.pop(1))
folder.mkdir(parents=True, exist_ok=True)
told = folder / "share-lies.jsonl"
corrupting = False  # in the gradient averager's process: a round it announced 1e9 in


def lies_that_met_a_group() -> set:
    lines = told.read_text().splitlines() if told.exists() else []
    return {json.loads(line)["share"] for line in lines if json.loads(line)["members"] > 1}


honest_step = DecentralizedAverager.step


def lying_step(self, gather=None, *args, **kwargs):
    # every version's announcement: [marker, share, ...]; the state averager's gather is not one
    announced = isinstance(self, averaging.PlannedAverager) and isinstance(gather, list) and len(gather) >= 3 and \
        gather[0] == PLAN_MARKER
    if announced and gather[1]:  # a plan gives it a share: planned to aggregate
        lies = [lie for lie in LIES if lie not in lies_that_met_a_group()]
        if lies:
            print(f"share lie: announcing {lies[0]!r} in place of {gather[1]!r}", flush=True)
            gather = [gather[0], lies[0], *gather[2:]]
    return honest_step(self, gather, *args, **kwargs)


honest_aggregate = averaging.PlannedAverager._aggregate_with_group


async def noting_aggregate(self, group_info, *args, **kwargs):
    global corrupting
    _, _, own = self.serializer.loads(group_info.gathered[group_info.peer_ids.index(self.peer_id)])
    share = self.serializer.loads(own)[1]
    if share in LIES:
        with open(told, "a") as file:
            file.write(json.dumps({"group": group_info.group_id.hex(), "share": share,
                                   "members": len(group_info.peer_ids)}) + "\n")
    corrupting = share == LIES[0]
    try:
        return await honest_aggregate(self, group_info, *args, **kwargs)
    finally:
        corrupting = False


honest_accumulate = TensorPartReducer.accumulate_part


async def corrupting_accumulate(self, *args, **kwargs):
    average = await honest_accumulate(self, *args, **kwargs)
    return average + LIE_OFFSET if corrupting else average


DecentralizedAverager.step = lying_step
averaging.PlannedAverager._aggregate_with_group = noting_aggregate
TensorPartReducer.accumulate_part = corrupting_accumulate

go_on()  # into the next wrapper on the command line, or the worker
