"""dedloc-worker: join a dedloc collaborative training run from your own machine.

- ``session``: what ``dedloc-worker join`` does, in order; ``cli``: the command and its errors (``errors``)
- ``portal/``: talking to the portal over HTTP (client, device login, the run's files)
- ``admission/``: this peer's key and token, the denylist, the gate on every RPC
- ``swarm/``: the DHT node, the optimizer it serves, signed records, leaving
- ``averaging/``: planned all-reduce rounds, matchmaking, state sharing, CenteredClip
- ``training/``: the training loop, progress records, device, checkpoints, spot checks, outer rounds
- ``credit/``: receipts and the outbox of claims
- ``tasks/``: what a run trains (built-in tasks and plugins)
- ``patches``: every replacement of a hivemind internal, installed in one place
- ``terminal``, ``progress``: what the volunteer sees
"""

__version__ = "0.1.0"
