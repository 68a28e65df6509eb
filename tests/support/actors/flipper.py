"""A worker patched to poison the model: it trains on its own data but sends sign-flipped gradients, and sketches
honestly what it sends (so its published sketch does not match its data), as an attacker would patch dedloc-worker.

    python tests/support/actors/flipper.py <dedloc-worker arguments>

Its reported losses are true: only the gradient is flipped (the loss it backpropagates is 2 * L.detach() - L).
"""

import sys

from dedloc_worker import cli, tasks

honest_build_task = tasks.build_task


def flipped_build_task(*args, **kwargs):
    task = honest_build_task(*args, **kwargs)
    honest_batch_loss = task.batch_loss

    def batch_loss(batch_size):
        loss = honest_batch_loss(batch_size)
        return 2 * loss.detach() - loss  # the same value, the gradient reversed

    task.batch_loss = batch_loss
    return task


tasks.build_task = flipped_build_task  # join.py imports it from the package when it runs
cli.main(sys.argv[1:])
