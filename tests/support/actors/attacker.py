"""An attacker against a running swarm, in its own process: it tries every kind of call on one victim peer and
prints, as JSON, what each returned ("refused", or "reached" when the victim's handler answered) and how many
attempts it made.

    python tests/support/actors/attacker.py VICTIM_MULTIADDR RUN_ID KEY_FILE [--token FILE] [--attempts N]

KEY_FILE holds the attacker's RSA private key (DER); --token a serialized AccessToken (absent: no token at all);
--attempts how many times it calls, at most (it stops once every call reached its handler).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import shutil
import tempfile
import time
from pathlib import Path

import hivemind
from dedloc_worker.admission.identity import PeerIdentity
from dedloc_worker.swarm.records import add_record_validators, publish_token, read_tokens
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

# A victim holds an unknown caller's call for its NEWCOMER_GRACE (6 s) while its keeper reads the tokens, so the
# first calls go out at once. A caller refused publishes its token again and waits this long before its next attempt
# (a few of the victims' admission rounds, 1 s apart): in full suite runs the control was once refused at first.
ADMISSION_WAIT = 4.0
ATTEMPTS = 3


class CarriesAnyToken(TokenAuthorizerBase):
    """Sends whatever token it was given and trusts every answer: an attacker checks nothing."""

    def __init__(self, token: AccessToken, key: RSAPrivateKey):
        super().__init__(key)
        self.token = token

    async def get_token(self) -> AccessToken:
        return self.token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return True

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return False


def load_key(path: Path) -> RSAPrivateKey:
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": path.read_bytes()})
    return key


async def outcome(call) -> str:
    try:
        result = await asyncio.wait_for(call(), timeout=15)
    except Exception as e:  # the victim refused or dropped the call
        return "refused" if "no valid token" in str(e) else f"refused ({type(e).__name__})"
    return "refused" if result is None else "reached"


def probe(victim: str, run_id: str, key: RSAPrivateKey, token: AccessToken | None, attempts: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="dedloc-attacker-"))
    identity = PeerIdentity(folder, key)
    authorizer = CarriesAnyToken(token, key) if token is not None else None
    victim_id = PeerID.from_base58(victim.rsplit("/p2p/", 1)[1])
    dht = hivemind.DHT(initial_peers=[victim], client_mode=True, identity_path=str(identity.identity_path),
                       authorizer=authorizer, ensure_bootstrap_success=False, start=True)
    try:
        if token is not None:  # announce the token as a legitimate worker does; a victim must still check it
            signature = add_record_validators(dht, run_id, key)
            publish_token(dht, run_id, signature, token)
            # and, like one, call only once the swarm can know it: a refusal must never be a matter of timing
            deadline = time.monotonic() + 10
            while token not in read_tokens(dht, run_id) and time.monotonic() < deadline:
                time.sleep(0.5)
        results = dht.run_coroutine(functools.partial(dht_calls, victim_id=victim_id, run_id=run_id))
        results.update(asyncio.run(averaging_calls(dht, victim_id, run_id)))
        made = 1
        while made < attempts and not all(result == "reached" for result in results.values()):
            if token is not None:
                publish_token(dht, run_id, signature, token)
            time.sleep(ADMISSION_WAIT)
            results.update(asyncio.run(averaging_calls(dht, victim_id, run_id)))
            made += 1
        return {"calls": results, "attempts": made}
    finally:
        dht.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


async def dht_calls(_dht, node, victim_id: PeerID, run_id: str) -> dict:
    """Runs inside the DHT process: find and store straight at the victim."""
    key_id = DHTID.generate(f"{run_id}_metrics")
    return {
        "dht_find": await outcome(lambda: node.protocol.call_find(victim_id, [key_id])),
        "dht_store": await outcome(lambda: node.protocol.call_store(victim_id, [key_id], [b"junk"],
                                                                    [get_dht_time() + 60])),
    }


async def averaging_calls(dht, victim_id: PeerID, run_id: str) -> dict:
    p2p = await dht.replicate_p2p()

    async def first_message(name: str, request, response_type):
        stream = await p2p.iterate_protobuf_handler(victim_id, name, request, response_type)
        async for message in stream:
            return message
        return None

    async def parts():
        yield averaging_pb2.AveragingData(group_id=b"attack", code=averaging_pb2.PART_FOR_AVERAGING)

    from dedloc_worker.averaging.planned import PlannedGradientAverager

    grad_averager = f"{run_id}_grad_averager::{PlannedGradientAverager.__name__}"  # the class names the handlers
    calls = {
        "matchmaking": lambda: first_message(
            f"{grad_averager}.rpc_join_group",
            averaging_pb2.JoinRequest(schema_hash=b"x", expiration=get_dht_time() + 5),
            averaging_pb2.MessageFromLeader),
        "allreduce_part": lambda: first_message(
            f"{grad_averager}.rpc_aggregate_part", parts(), averaging_pb2.AveragingData),
        "state_download": lambda: first_message(
            f"{run_id}_state_averager::TrainingStateAverager.rpc_download_state",
            averaging_pb2.DownloadRequest(), averaging_pb2.DownloadData),
    }
    try:
        outcomes = await asyncio.gather(*(outcome(call) for call in calls.values()))
        return dict(zip(calls, outcomes))
    finally:
        await p2p.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("victim")
    parser.add_argument("run_id")
    parser.add_argument("key_file", type=Path)
    parser.add_argument("--token", type=Path)
    parser.add_argument("--attempts", type=int, default=ATTEMPTS)
    args = parser.parse_args()
    token = AccessToken.FromString(args.token.read_bytes()) if args.token else None
    print(json.dumps(probe(args.victim, args.run_id, load_key(args.key_file), token, args.attempts)), flush=True)


if __name__ == "__main__":
    main()
