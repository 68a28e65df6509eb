"""Attacks on a running swarm of legitimate workers, each from a real process on loopback: a peer without a
valid token of the run gets nothing out of it, on any RPC."""

from __future__ import annotations

import json
import signal
import sys
import time

import pytest
from dedloc_common.signing import new_private_key
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey

from app.authority import tokens
from app.core.config import Settings
from app.core.database import make_engine, make_sessionmaker
from app.core.processes import group_members
from app.runs import registry
from tests.support.actors import ATTACKER
from tests.support.factories import peer_token
from tests.support.harness import wait_for

pytestmark = pytest.mark.swarm
CALLS = ("dht_find", "dht_store", "matchmaking", "allreduce_part", "state_download")


def start_attack(deployment, victim: str, key: RSAPrivateKey, token: AccessToken | None, name: str, *options: str):
    """Start the attacker process with ``key`` as its identity and ``token`` (or none)."""
    key_file = deployment.workdir / f"{name}.der"
    key_file.write_bytes(key.to_bytes())
    args = [sys.executable, str(ATTACKER), victim, f"dedloc-{deployment.slug}", str(key_file)]
    if token is not None:
        token_file = deployment.workdir / f"{name}.token"
        token_file.write_bytes(token.SerializeToString())
        args += ["--token", str(token_file)]
    args += options
    return deployment.start(f"attacker-{name}", *args[1:])


def outcome_of(deployment, name: str) -> dict:
    """What a finished attacker's calls returned (``calls``), in how many ``attempts``."""
    assert deployment.wait_exit(f"attacker-{name}", timeout=120) == 0
    lines = (deployment.logs / f"attacker-{name}.log").read_text().splitlines()
    return json.loads(next(line for line in reversed(lines) if line.startswith("{")))


def test_no_token_forged_expired_stolen_or_banned_gets_nothing_and_a_killed_peer_leaves_a_survivor(deployment):
    deployment.start_swarm(["alice", "bob"], "--max-epochs", "60")
    # the victim is alice, training since she founded the run; the attacks run while bob joins
    victim = wait_for(deployment.worker_addresses, 30, "a worker address")[0]

    settings = Settings(data_dir=deployment.workdir / "var")
    engine = make_engine(deployment.database_url)
    with make_sessionmaker(engine)() as session:
        run = registry.get_run(session, deployment.slug)
        authority = tokens.authority_key(session, settings, run)
        mallory_key = RSAPrivateKey()
        mallory = peer_token(authority, "mallory", mallory_key, 600)
        tokens.ban_user(session, run, "mallory", banned_by="test")
    engine.dispose()

    # The harness itself must be able to reach everything: a legitimate token on the attacker's own key. Each
    # attacker then gets as many attempts as it took her: a refusal is never a matter of timing.
    carol = RSAPrivateKey()
    start_attack(deployment, victim, carol, peer_token(authority, "carol", carol, 600), "control")
    control = outcome_of(deployment, "control")
    assert control["calls"] == {call: "reached" for call in CALLS}, control

    # Each attacker has a fresh key (carol's stays admitted while her token lives).
    keys = {name: RSAPrivateKey() for name in ("none", "forged", "expired", "stolen")}
    attempts = {
        "no token": (keys["none"], None),
        "forged": (keys["forged"], peer_token(new_private_key(), "alice", keys["forged"], 600)),
        "expired": (keys["expired"], peer_token(authority, "alice", keys["expired"], -60)),
        "stolen (valid token of another key)": (keys["stolen"], peer_token(authority, "alice", RSAPrivateKey(), 600)),
        "banned": (mallory_key, mallory),
    }
    for name, (key, token) in attempts.items():  # all at once: the swarm is under attack from five sides
        start_attack(deployment, victim, key, token, name.split()[0], "--attempts", str(control["attempts"]))
    for name in attempts:
        outcome = outcome_of(deployment, name.split()[0])
        refused = {call: result for call, result in outcome["calls"].items() if result.startswith("refused")}
        assert set(refused) == set(CALLS) and outcome["attempts"] == control["attempts"], f"{name}: {outcome}"

    wait_for(lambda: deployment.swarm()["peers_online"] == 2, 90, "both workers online")
    # Then an honest peer dies without a goodbye (SIGKILL): hivemind's children outlive it (docs/hivemind.md#pitfalls,
    # pitfall 3) until its process group is ended, and the survivor carries on alone within the averaging timeout.
    bob = deployment.processes["bob"]
    deployment.kill("bob")
    assert group_members(bob.pid), "expected hivemind's children to outlive a SIGKILLed worker"
    deployment.reap("bob")
    assert group_members(bob.pid) == []
    killed_at = time.monotonic()
    wait_for(lambda: deployment.swarm()["peers_online"] == 1, 30, "peers_online to drop to 1")
    print(f"peers_online dropped {time.monotonic() - killed_at:.1f} s after the kill")
    epoch = deployment.swarm()["epoch"]
    wait_for(lambda: deployment.swarm()["epoch"] >= epoch + 1, 90, "alice to carry on alone")
    assert deployment.stop("alice", signal.SIGINT, grace=30) == 0, (deployment.logs / "alice.log").read_text()[-3000:]
