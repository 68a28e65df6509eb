"""RSA signatures exactly as hivemind makes them (PSS, MGF1-SHA256, maximal salt; base64), without hivemind.

The portal signs peer tokens with these functions and must not import hivemind; hivemind verifies them with
``RSAPublicKey.verify``. A test pins that the two agree.
"""

from __future__ import annotations

import base64

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


def new_private_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def sign(private_key: rsa.RSAPrivateKey, data: bytes) -> str:
    return base64.b64encode(private_key.sign(data, PADDING, hashes.SHA256())).decode()


def verify(public_key: rsa.RSAPublicKey, data: bytes, signature: str | bytes) -> bool:
    try:
        public_key.verify(base64.b64decode(signature, validate=True), data, PADDING, hashes.SHA256())
        return True
    except (ValueError, InvalidSignature):
        return False


def public_openssh(private_key: rsa.RSAPrivateKey) -> bytes:
    return private_key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


def load_public_openssh(data: bytes | str) -> rsa.RSAPublicKey:
    """An RSA public key in OpenSSH format; ``ValueError`` for anything else."""
    key = serialization.load_ssh_public_key(data.encode() if isinstance(data, str) else data)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("expected an RSA public key")
    if key.key_size < 2048:
        raise ValueError("RSA keys shorter than 2048 bits are refused")
    return key


def peer_id_of(public_key: bytes | str) -> str:
    """The libp2p PeerID (base58) of an RSA key given in OpenSSH format: the SHA-256 multihash of the protobuf
    ``PublicKey{Type: RSA, Data: DER SubjectPublicKeyInfo}``. What a peer's ``context.remote_id`` will read."""
    import hashlib

    import base58

    der = load_public_openssh(public_key).public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = b"\x08\x00\x12" + _varint(len(der)) + der  # field 1: KeyType RSA (0); field 2: key bytes
    return base58.b58encode(b"\x12\x20" + hashlib.sha256(encoded).digest()).decode()


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)
