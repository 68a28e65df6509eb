"""The schema and the crediting rules on a real database: SQLite, and PostgreSQL started by the test run."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect

from app.core.database import downgrade, make_engine, migrate
from app.core.errors import Invalid, NotFound
from app.runs import registry

TABLES = {"runs", "coordinators", "snapshots", "contributions", "users", "api_credentials", "device_codes", "receipts",
          "peers",
          "peer_tokens", "run_bans", "run_allowlist", "averaging_plans", "run_organizers", "checkpoints",
          "disputes", "spot_checks", "evaluations"}


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


def test_issued_tokens_keep_their_peer_key_through_the_column_rename(database_url):
    # 0006 renames peer_tokens.record_key to peer_key: rows written before must keep the value, and the index.
    from sqlalchemy import text

    migrate(database_url, "0005")
    engine = make_engine(database_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("INSERT INTO runs (slug, title, task, task_options, target_batch_size, batch_size,"
                                    " seed, optimizer, created_at, admission, samples_per_second_ceiling) VALUES"
                                    " ('r', 'R', 't', '{}', 64, 8, 0, '{}', '2026-01-01', 'open', 5000)"))
            connection.execute(text("INSERT INTO peer_tokens (run_id, username, peer_public_key, peer_id, record_key,"
                                    " issued_at, expires_at) SELECT id, 'alice', '-', 'Qm1', 'abc', '2026-01-01',"
                                    " '2026-01-02' FROM runs"))
        migrate(database_url)
        with engine.connect() as connection:
            assert connection.execute(text("SELECT peer_key FROM peer_tokens")).scalar_one() == "abc"
        assert {"ix_peer_tokens_peer_key"} <= {ix["name"] for ix in inspect(engine).get_indexes("peer_tokens")}
        downgrade(database_url, "0005")
        with engine.connect() as connection:
            assert connection.execute(text("SELECT record_key FROM peer_tokens")).scalar_one() == "abc"
    finally:
        engine.dispose()


def test_the_models_match_the_migrations(database_url):
    """A table or column added to app/models.py without a migration (or the other way) shows here."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    import app.identity.models  # noqa: F401  (its tables join Base.metadata)
    from app.models import Base

    migrate(database_url)
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    finally:
        engine.dispose()
