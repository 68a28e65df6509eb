"""Builders shared by test modules: credited contributions, the accounting scenario of the read-side tests, and
peer tokens signed by a run's authority."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from dedloc_common.contract import EpochContribution, token_payload
from dedloc_common.signing import sign
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey

from app.identity.models import User
from app.models import Contribution, Peer
from app.runs import registry

# contributions ---------------------------------------------------------------------------------------------------


def contribution(epoch: int, samples: int) -> EpochContribution:
    return EpochContribution(epoch=epoch, samples=samples, loss_sum=2.0 * samples, mini_steps=samples // 16,
                             seconds=1.5)


def seed_credit(session, run, peer_key: str, username: str, *contributions: EpochContribution) -> None:
    """Credited rows as the coordinator leaves them once receipts confirmed every claim (for read-side tests)."""
    for c in contributions:
        session.add(Contribution(run_id=run.id, peer_key=peer_key, epoch=c.epoch, username=username,
                                 samples=c.samples, loss_sum=c.loss_sum, mini_steps=c.mini_steps, seconds=c.seconds,
                                 credited=c.samples, held=0))
    session.commit()


# the accounting scenario (see populate) ---------------------------------------------------------------------------

ALICE_KEY, ALICE_KEY_2 = "ab12cd34" + "5" * 56, "ef56ab78" + "9" * 56
TOO_FAST = "claimed 40,000 samples/s, ceiling is 5,000"
ALONE = "alone in its averaging group"
START = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)
HIDDEN_NAME = "carol-hidden"  # distinctive: found in a page only if the page names her


def add(session, run, username, key, epoch, samples, credited=None, reason=None):
    credited = samples if credited is None else credited
    session.add(Contribution(run_id=run.id, peer_key=key, epoch=epoch, username=username, samples=samples,
                             loss_sum=2.0 * samples, mini_steps=samples // 16, seconds=2.0, credited=credited,
                             held=samples - credited, reason=reason, recorded_at=START + timedelta(minutes=epoch)))


def populate(session) -> None:
    """Two runs. demo: alice 600 credited and 400 held (two reasons), bob 700, the hidden carol 5,000, ghost (no
    user row) 50. second: alice 1,000, dave (no team) 200 and 20 held. alice, bob and carol are in team hf-org."""
    demo = registry.create_run(session, slug="demo", title="Demo run")
    second = registry.create_run(session, slug="second", title="Second run")
    session.add_all([
        User(username="alice", team="hf-org", organizations=["hf-org", "other-org"]),
        User(username="bob", team="hf-org", organizations=["hf-org"]),
        User(username=HIDDEN_NAME, team="hf-org", organizations=["hf-org"], hidden=True),
        User(username="dave"), User(username="olivia"),
        Peer(run_id=demo.id, peer_key=ALICE_KEY, username="alice", hardware="NVIDIA GeForce RTX 3090 (24 GiB)",
             first_seen=START, last_seen=START + timedelta(minutes=3)),
        Peer(run_id=second.id, peer_key=ALICE_KEY_2, username="alice", hardware="CPU, 8 cores",
             first_seen=START, last_seen=START + timedelta(minutes=1)),
        Peer(run_id=demo.id, peer_key="c" * 64, username=HIDDEN_NAME, hardware="secret box"),
    ])
    add(session, demo, "alice", ALICE_KEY, 0, 300)
    add(session, demo, "alice", ALICE_KEY, 1, 200)
    add(session, demo, "alice", ALICE_KEY, 2, 400, credited=100, reason=TOO_FAST)
    add(session, demo, "alice", ALICE_KEY, 3, 100, credited=0, reason=ALONE)
    add(session, demo, "bob", "b" * 64, 1, 700)
    add(session, demo, HIDDEN_NAME, "c" * 64, 1, 5000)
    add(session, demo, "ghost", "d" * 64, 2, 50)
    add(session, second, "alice", ALICE_KEY_2, 0, 1000)
    add(session, second, "dave", "e" * 64, 0, 220, credited=200, reason=ALONE)
    session.commit()


# peer tokens -----------------------------------------------------------------------------------------------------


def peer_token(authority, username: str, peer_key: RSAPrivateKey, lifetime: float = 600) -> AccessToken:
    """A hivemind access token for ``peer_key``, signed by ``authority`` and valid for ``lifetime`` seconds."""
    expires = (datetime.now(timezone.utc) + timedelta(seconds=lifetime)).replace(tzinfo=None)
    expiration_time = expires.isoformat(timespec="seconds")
    public_key = peer_key.get_public_key().to_bytes()
    signature = sign(authority, token_payload(username, public_key, expiration_time))
    return AccessToken(username=username, public_key=public_key, expiration_time=expiration_time,
                       signature=signature.encode())


# training --------------------------------------------------------------------------------------------------------


class LocalSteps:
    """Stands in for hivemind's optimizer where one peer trains alone: ``training.loop.mini_step`` only steps and
    zeroes (the gradients stay in the tally's sketch)."""

    def __init__(self, model):
        self.model = model

    def step(self, **_):
        pass

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)
