"""A worker patched to lie about its contribution, as a cheater would patch dedloc-worker.

    python tests/support/actors/liar.py metrics|both <dedloc-worker arguments>
    python tests/support/actors/liar.py metrics|both tests/support/actors/witness.py FOLDER <dedloc-worker arguments>
        (a liar, witnessed)

metrics: claims 100x its samples in its signed metrics record only.
both:    also averages with 100x its weight, so aggregators see (and confirm) the inflated number.
"""

import sys

from chain import go_on
from dedloc_worker.training import loop as trainer

# far past the test's ceiling of 3x a solo worker's rate, however slow the shared cores make this one (at 30x,
# a liar that got 4% of a core stayed under it)
INFLATION = 100
mode = sys.argv.pop(1)
honest_close_epoch = trainer.close_epoch


def inflated_close_epoch(*args):
    contribution = honest_close_epoch(*args)
    return contribution.copy(update={"samples": contribution.samples * INFLATION})


trainer.close_epoch = inflated_close_epoch

if mode == "both":
    from hivemind.optim.grad_averager import GradientAverager

    honest_step = GradientAverager.step

    def inflated_step(self, weight=None, **kwargs):
        return honest_step(self, weight=self.local_samples_accumulated * INFLATION, **kwargs)

    GradientAverager.step = inflated_step

go_on()  # into the next wrapper on the command line, or the worker
