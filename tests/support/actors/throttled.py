"""dedloc-worker training FACTOR times slower than the machine lets it, as a volunteer's slower GPU would.

    python tests/support/actors/throttled.py FACTOR <dedloc-worker arguments>
    python tests/support/actors/throttled.py FACTOR tests/support/actors/witness.py FOLDER <dedloc-worker arguments>
        (throttled, witnessed)

Each mini-step sleeps (FACTOR - 1) times what it took, in the training thread only: the averager and the DHT run
as fast as they would, and the measured rate the worker reports is its own.
"""

import sys
import time

from chain import go_on
from dedloc_worker.training import loop as trainer

factor = float(sys.argv.pop(1))
unthrottled = trainer.mini_step


def throttled(*args, **kwargs):
    began = time.perf_counter()
    finite = unthrottled(*args, **kwargs)
    time.sleep((factor - 1) * (time.perf_counter() - began))
    return finite


trainer.mini_step = throttled

go_on()  # into the next wrapper on the command line, or the worker
