"""The schema and the crediting rules on a real database: SQLite, and PostgreSQL started by the test run."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect

from app.runs import registry
from app.core.database import downgrade, make_engine, migrate
from app.core.errors import Invalid, NotFound

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
