"""How pages and the API name a volunteer's machine: a short fingerprint of its peer key (contract.peer_key_of).

One label for one machine everywhere: the owner's own page and the run's averaging plan show the same characters.
"""

from __future__ import annotations

# Enough to tell one's machines apart on a page, far too little to name, dial or impersonate a key.
FINGERPRINT_CHARS = 8


def fingerprint(peer_key: str) -> str:
    """The first characters of ``peer_key`` (hex), never more."""
    return peer_key[:FINGERPRINT_CHARS]
