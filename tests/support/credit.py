"""Builders for crediting tests on a real database: runs the coordinator has watched a while, workers' keys with
issued tokens, claims with their rounds' members and receipts, and the totals the ledger holds."""

from __future__ import annotations

import functools
from datetime import timedelta

from dedloc_common.contract import EpochContribution, MetricsRecord, peer_key_of
from dedloc_common.signing import peer_id_of
from hivemind.utils.crypto import RSAPrivateKey
from sqlalchemy import select

from app.authority.tokens import issue_peer_token
from app.core.clock import utcnow
from app.core.config import Settings
from app.credit.ledger import SignedMetrics
from app.models import Contribution
from app.runs import registry


def aged_run(session, slug: str, age: timedelta = timedelta(hours=1), **options):
    """A run its coordinator has watched for ``age`` without a snapshot: every epoch may have lasted that long."""
    run = registry.create_run(session, slug=slug, title=slug.title(), **options)
    run.created_at = utcnow() - age
    session.commit()
    return run


@functools.lru_cache(maxsize=None)
def public_key(index: int) -> bytes:
    """The ``index``-th of a pool of RSA public keys (OpenSSH format): made once per test session (they are slow)."""
    return RSAPrivateKey().get_public_key().to_bytes()


class Peer:
    """A worker's key with a token of ``run`` issued to ``username``; ``index`` picks a key from the pool (a fresh
    key when None)."""

    def __init__(self, session, run, username: str, tmp_path, index: int | None = None):
        key = RSAPrivateKey().get_public_key().to_bytes() if index is None else public_key(index)
        self.key, self.username = peer_key_of(key), username
        grant = issue_peer_token(session, Settings(data_dir=tmp_path), run, username, key.decode())
        self.peer_id = peer_id_of(grant.token.public_key)

    def record(self, *claims: EpochContribution) -> SignedMetrics:
        return SignedMetrics(self.key, MetricsRecord(username=self.username, epoch=9, samples_per_second=1.0,
                                                     time=0.0, recent=list(claims)))


def claim(epoch: int, samples: int, group: str = "g", aggregated: dict | None = None,
          members: list | None = None, seconds: float = 1.0) -> EpochContribution:
    """A claim in round ``group``; unless given, its members are every sender it aggregated (who averaged with it)."""
    if members is None:
        members = sorted({sender for senders in (aggregated or {}).values() for sender in senders})
    return EpochContribution(epoch=epoch, samples=samples, loss_sum=1.0, mini_steps=1, seconds=seconds, group=group,
                             aggregated=aggregated or {}, members=members)


def totals(session, run=None) -> dict[str, tuple[int, int]]:
    """username -> (credited, held) samples, in ``run`` or everywhere."""
    query = select(Contribution.username, Contribution.credited, Contribution.held)
    if run is not None:
        query = query.where(Contribution.run_id == run.id)
    found: dict[str, tuple[int, int]] = {}
    for username, credited, held in session.execute(query):
        c, h = found.get(username, (0, 0))
        found[username] = (c + credited, h + held)
    return found
