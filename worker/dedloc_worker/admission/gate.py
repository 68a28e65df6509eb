"""Admission: no peer without a valid token of this run gets anything out of this process.

hivemind's ``authorizer`` protects only the DHT (ping, store, find). Matchmaking, all-reduce parts and state
download are open to any libp2p peer that knows one address (docs/hivemind.md#authorization). So:

- ``RunAuthorizer`` (a ``TokenAuthorizerBase``) guards the DHT: the caller's token must be signed by the run's
  authority, unexpired, and not of a banned user.
- ``guard_handlers`` wraps every *other* handler registered on a libp2p node of this process and its children
  (the averagers run in forked processes): the caller's authenticated PeerID must belong to a valid token.
- Which PeerIDs hold valid tokens is decided locally, by the ``admission.keeper.AdmissionKeeper`` thread of the main
  process: it reads the tokens every peer publishes in the DHT and the coordinator's signed denylist, verifies them with
  the authority's public key, and writes the verdict into a file the child processes read. No call to the portal per
  RPC.

The hivemind internals this relies on (``P2P.add_protobuf_handler``, ``P2PContext.remote_id``, the DHT's handler
names, ``TokenAuthorizerBase``) are pinned by tests/test_admission.py.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from functools import wraps
from pathlib import Path
from typing import Callable, Optional

from dedloc_common.contract import PeerToken, token_payload
from dedloc_common.signing import load_public_openssh, peer_id_of, verify
from hivemind.p2p import P2P
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.timed_storage import get_dht_time

# A handler refuses an unknown caller only after giving the keeper this long to learn a newcomer's token.
NEWCOMER_GRACE = 6.0
DHT_HANDLERS = "DHTProtocol."  # guarded by RunAuthorizer, which sees the token inside each request


def parse_expiration(text: str) -> float:
    """Seconds since the epoch of a token's naive-UTC expiration time."""
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


def to_access_token(token: PeerToken) -> AccessToken:
    return AccessToken(username=token.username, public_key=token.public_key.encode(),
                       expiration_time=token.expiration_time, signature=token.signature.encode())


class TokenCheck:
    """Verifies tokens against the run's authority key and a set of banned usernames."""

    def __init__(self, authority_public_key: str):
        self.authority = load_public_openssh(authority_public_key)

    def verdict(self, token: AccessToken, denied: frozenset = frozenset(), now: Optional[float] = None) -> str:
        """'' when the token is valid, else why not (in words)."""
        payload = token_payload(token.username, token.public_key, token.expiration_time)
        if not verify(self.authority, payload, token.signature):
            return "its signature is not the run's authority's"
        try:
            if parse_expiration(token.expiration_time) < (now or time.time()):
                return "it has expired"
        except ValueError:
            return "its expiration time is malformed"
        if token.username in denied:
            return f"{token.username} is banned"
        return ""


class AdmissionState:
    """Files in a private folder that the main process writes and hivemind's child processes read:
    this peer's current token, and which PeerIDs are admitted."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.token_path, self.allow_path = folder / "token.bin", folder / "admitted.json"
        self.wanted_path = folder / "wanted"
        self._cache: tuple[tuple, dict] = ((), {"peers": {}, "denied": []})
        self._token_cache: tuple[tuple, bytes] = ((), b"")

    def write_token(self, token: AccessToken) -> None:
        self._write(self.token_path, token.SerializeToString())

    def read_token(self) -> AccessToken:
        return AccessToken.FromString(self.token_bytes())

    def token_bytes(self) -> bytes:
        """The token file's bytes, read again only when the keeper has replaced it (the DHT asks on every RPC)."""
        found = self.token_path.stat()
        stamp = (found.st_mtime_ns, found.st_ino)  # each write replaces the file: a new inode, even within a tick
        if stamp != self._token_cache[0]:
            self._token_cache = (stamp, self.token_path.read_bytes())
        return self._token_cache[1]

    def want(self, peer_id: str) -> None:
        """A handler met a caller it does not know yet: ask the keeper to read the DHT's tokens now."""
        self._write(self.wanted_path, peer_id.encode())

    def wanted(self) -> tuple:
        """Changes each time a handler asks for a read (``want``); () when none has."""
        try:
            found = self.wanted_path.stat()
        except FileNotFoundError:
            return ()
        return found.st_mtime_ns, found.st_ino

    def write_admitted(self, peers: dict[str, float], denied: list[str]) -> None:
        self._write(self.allow_path, json.dumps({"peers": peers, "denied": sorted(denied)}).encode())

    def admitted(self) -> dict:
        try:
            found = self.allow_path.stat()
        except FileNotFoundError:
            return {"peers": {}, "denied": []}
        stamp = (found.st_mtime_ns, found.st_ino)
        if stamp != self._cache[0]:
            self._cache = (stamp, json.loads(self.allow_path.read_text()))
        return self._cache[1]

    def denied(self) -> frozenset:
        return frozenset(self.admitted()["denied"])

    def admits(self, peer_id: str) -> bool:
        expiry = self.admitted()["peers"].get(peer_id)
        return expiry is not None and expiry > time.time()

    def _write(self, path: Path, data: bytes) -> None:
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # handlers of several processes write too
        temporary.write_bytes(data)
        os.replace(temporary, path)


class RunAuthorizer(TokenAuthorizerBase):
    """The DHT's authorizer: this peer's token comes from ``state``; callers' tokens are checked locally."""

    def __init__(self, check: TokenCheck, state: AdmissionState, local_private_key=None):
        super().__init__(local_private_key)
        self.check, self.state = check, state

    async def get_token(self) -> AccessToken:
        return self.state.read_token()

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return self.check.verdict(access_token, self.state.denied()) == ""

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        # The keeper refreshes the file well before expiry; pick up whatever it wrote.
        return access_token.SerializeToString() != self.state.token_bytes()


async def wait_admitted(state: AdmissionState, peer_id: str, grace: float = NEWCOMER_GRACE) -> bool:
    import asyncio

    deadline = time.monotonic() + grace
    if not state.admits(peer_id):
        state.want(peer_id)
    while not state.admits(peer_id):
        if time.monotonic() > deadline or str(peer_id) in state.denied():
            return False
        await asyncio.sleep(0.25)
    return True


def guard_handlers(state: AdmissionState) -> None:
    """Make every non-DHT handler registered from now on (in this process and its forks) refuse callers whose
    PeerID holds no valid token. Call before creating the DHT or any averager."""
    original = getattr(P2P.add_protobuf_handler, "__wrapped__", P2P.add_protobuf_handler)

    @wraps(original)
    async def add_protobuf_handler(self, name, handler, input_protobuf_type, *, stream_input=False,
                                   stream_output=False, balanced=False):
        if not name.split("::")[-1].startswith(DHT_HANDLERS):
            handler = _guarded(handler, name, state, streaming=stream_input or stream_output)
        return await original(self, name, handler, input_protobuf_type, stream_input=stream_input,
                              stream_output=stream_output, balanced=balanced)

    P2P.add_protobuf_handler = add_protobuf_handler


class Refused(PermissionError):
    pass


def _guarded(handler: Callable, name: str, state: AdmissionState, streaming: bool) -> Callable:
    async def refuse_unless_admitted(context) -> None:
        if not await wait_admitted(state, str(context.remote_id)):
            raise Refused(f"{context.remote_id} holds no valid token of this run; {name} refused")

    if streaming:
        async def guarded_stream(request, context):
            await refuse_unless_admitted(context)
            output = handler(request, context)
            if hasattr(output, "__aiter__"):
                async for item in output:
                    yield item
            else:
                yield await output

        return guarded_stream

    async def guarded_unary(request, context):
        await refuse_unless_admitted(context)
        return await handler(request, context)

    return guarded_unary


def admitted_peers(tokens: list[AccessToken], check: TokenCheck, denied: frozenset) -> dict[str, float]:
    """PeerID -> expiry (seconds since the epoch) for every valid token seen."""
    peers: dict[str, float] = {}
    now = get_dht_time()
    for token in tokens:
        if check.verdict(token, denied, now) == "":
            try:
                peer = peer_id_of(token.public_key)
            except ValueError:
                continue
            peers[peer] = max(peers.get(peer, 0.0), parse_expiration(token.expiration_time))
    return peers
