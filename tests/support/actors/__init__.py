"""Code that runs in a process a test starts, not in the test's own: run as scripts, or loaded by the worker.

- ``attacker.py``: a peer without a valid token trying every RPC on a victim (tests/test_attacks.py).
- ``liar.py``: dedloc-worker patched to claim 100x its samples (tests/test_swarm.py).
- ``share_liar.py``: dedloc-worker announcing a share of 1e9, then 0, in place of its planned one (tests/test_swarm.py).
- ``witness.py``: dedloc-worker recording every gradient all-reduce it takes part in (tests/test_swarm.py).
- ``throttled.py``: dedloc-worker training several times slower than the machine lets it (tests/test_swarm.py).
- ``flipper.py``: dedloc-worker sending sign-flipped gradients, sketched as sent (tests/test_spot_checks.py).
- ``poisoner.py``: one peer of a four-peer averaging swarm, honest or poisoning (tests/test_robust_aggregation.py).
- ``chain.py``: how liar.py, share_liar.py and throttled.py go on: into the next wrapper on the command line, else
  the worker.
- ``faulty_task.py``: a task plugin that raises after a few mini-steps, loaded by the worker as
  ``tests.support.actors.faulty_task:ExplodingTask`` (tests/test_hivemind.py).
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent
ATTACKER = HERE / "attacker.py"
LIAR = HERE / "liar.py"
SHARE_LIAR = HERE / "share_liar.py"
WITNESS = HERE / "witness.py"
THROTTLED = HERE / "throttled.py"
FLIPPER = HERE / "flipper.py"
POISONER = HERE / "poisoner.py"
FAULTY_TASK = "tests.support.actors.faulty_task:ExplodingTask"
