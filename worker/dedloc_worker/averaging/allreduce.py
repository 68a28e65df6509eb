"""The end of hivemind 1.1.12's ``DecentralizedAverager._run_allreduce_inplace_``, shared by the averagers that
build their own ``AllReduceRunner`` (``averaging.planned.PlannedAverager``,
``averaging.state_sharing.ClipsStateRounds``)."""

from __future__ import annotations

from typing import Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip


async def average_in_place(averager, runner: AllReduceRunner, group_info: GroupInfo, group_id: bytes,
                           tensors: Sequence[torch.Tensor]) -> None:
    """Hand ``runner`` to the handlers waiting for ``group_id``, then add each averaged update into ``tensors`` (an
    auxiliary peer receives none), as hivemind 1.1.12 does."""
    assert group_id in averager._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
    averager._running_groups[group_id].set_result(runner)
    if runner.modes[group_info.peer_ids.index(averager.peer_id)] != AveragingMode.AUX:
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update, alpha=averager._averaging_alpha)
            averager.last_updated = get_dht_time()
            averager._state_updated.set()
    else:
        async for _ in runner:
            raise ValueError("aux peers should not receive averaged tensors")
