"""One RSA key per worker process: its libp2p identity, the key in its peer token, the owner of its records."""

from __future__ import annotations

import os
from pathlib import Path

from dedloc_common.signing import peer_id_of
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey


class PeerIdentity:
    """This process's key (hivemind's process-wide key, so the Optimizer's signed records use it too).

    :param folder: a private folder; the libp2p identity file for p2pd is written there with mode 0600
    """

    def __init__(self, folder: Path, private_key: RSAPrivateKey | None = None):
        self.private_key = private_key or RSAPrivateKey.process_wide()
        self.public_key: bytes = self.private_key.get_public_key().to_bytes()  # OpenSSH format
        self.peer_id = peer_id_of(self.public_key)
        self.identity_path = folder / "identity.key"
        encoded = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=self.private_key.to_bytes())
        descriptor = os.open(self.identity_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(encoded.SerializeToString())


def persistent_key(path: Path) -> RSAPrivateKey:
    """The RSA key of a libp2p identity file (created, mode 0600, when missing), made this process's key: a peer
    that keeps its PeerID across restarts (the coordinator) then holds tokens for the same key its PeerID names,
    which is what workers admit on their averager's handlers."""
    if path.exists():
        encoded = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": encoded.data})  # DER, as hivemind's own identity files hold it
    else:
        key = RSAPrivateKey()
        encoded = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=key.to_bytes())
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(encoded.SerializeToString())
    RSAPrivateKey._process_wide_key = key
    return key
