"""The schema and the crediting rules on a real database: SQLite, and PostgreSQL started by the test run."""

from __future__ import annotations

import pytest
from dedloc_common.contract import EpochContribution
from sqlalchemy import inspect

from app.runs import registry
from app.core.database import downgrade, make_engine, migrate
from app.core.errors import Invalid, NotFound
from app.models import Contribution

TABLES = {"runs", "coordinators", "snapshots", "contributions", "users", "api_credentials", "device_codes", "receipts", "peers",
          "peer_tokens", "run_bans", "run_allowlist", "averaging_plans"}


def table_names(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_migrations_go_up_to_head_and_back_to_base(database_url):
    migrate(database_url)
    assert table_names(database_url) == TABLES
    downgrade(database_url, "base")
    assert table_names(database_url) == set()
    migrate(database_url)  # and up again: the chain is repeatable
    assert table_names(database_url) == TABLES


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


def test_runs_refuse_bad_slugs_duplicates_and_batches(sessions):
    with sessions() as session:
        registry.create_run(session, slug="taken", title="Taken")
        with pytest.raises(Invalid, match="already exists"):
            registry.create_run(session, slug="taken", title="Again")
        with pytest.raises(Invalid, match="lowercase"):
            registry.create_run(session, slug="Bad Slug!", title="Bad")
        with pytest.raises(Invalid, match="target_batch_size"):
            registry.create_run(session, slug="tiny", title="Tiny", target_batch_size=8, batch_size=16)
        with pytest.raises(NotFound):
            registry.get_run(session, "missing")
