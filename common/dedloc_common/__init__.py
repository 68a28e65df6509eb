"""What the portal and the worker share without the swarm stack: the wire contract (``contract``), token
signing (``signing``) and ending child processes (``cleanup``)."""
