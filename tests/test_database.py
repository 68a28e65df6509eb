"""The schema and the crediting rules on a real database: SQLite, and PostgreSQL started by the test run."""

from __future__ import annotations

import pytest
from dedloc_worker.contract import EpochContribution, MetricsRecord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import inspect

from app import runs
from app.accounting import SignedMetrics, credit_contributions, leaderboard, samples_total
from app.db import downgrade, make_engine, migrate
from app.errors import Invalid, NotFound

TABLES = {"runs", "coordinators", "snapshots", "contributions", "users", "api_credentials", "device_codes", "receipts", "peers",
          "peer_tokens", "run_bans", "run_allowlist"}


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


def signed(peer: str, username: str, *contributions: EpochContribution) -> SignedMetrics:
    record = MetricsRecord(username=username, epoch=max(c.epoch for c in contributions) + 1,
                           samples_per_second=100.0, time=0.0, recent=list(contributions))
    return SignedMetrics(peer, record)


def test_crediting_counts_each_peer_epoch_once(sessions):
    with sessions() as session:
        run = runs.create_run(session, slug="credit", title="Credit")
        first = [signed("k1", "alice", contribution(0, 64), contribution(1, 32)), signed("k2", "bob", contribution(1, 48))]
        assert credit_contributions(session, run, first) == 3
        assert credit_contributions(session, run, first) == 0  # the same records polled again
        later = [signed("k1", "alice", contribution(1, 32), contribution(2, 16))]  # the window moved on
        assert credit_contributions(session, run, later) == 1
        assert samples_total(session, run) == 64 + 32 + 48 + 16
        board = leaderboard(session, run)
        assert [(row.username, row.samples, row.peers) for row in board] == [("alice", 112, 1), ("bob", 48, 1)]
        assert board[0].runtime_seconds == pytest.approx(4.5)


def test_a_worker_restarted_with_a_new_key_is_credited_under_both_keys(sessions):
    with sessions() as session:
        run = runs.create_run(session, slug="rekey", title="Rekey")
        credit_contributions(session, run, [signed("old", "carol", contribution(3, 10))])
        credit_contributions(session, run, [signed("new", "carol", contribution(3, 20))])
        board = leaderboard(session, run)
        assert [(row.username, row.samples, row.peers) for row in board] == [("carol", 30, 2)]


def test_runs_refuse_bad_slugs_duplicates_and_batches(sessions):
    with sessions() as session:
        runs.create_run(session, slug="taken", title="Taken")
        with pytest.raises(Invalid, match="already exists"):
            runs.create_run(session, slug="taken", title="Again")
        with pytest.raises(Invalid, match="lowercase"):
            runs.create_run(session, slug="Bad Slug!", title="Bad")
        with pytest.raises(Invalid, match="target_batch_size"):
            runs.create_run(session, slug="tiny", title="Tiny", target_batch_size=8, batch_size=16)
        with pytest.raises(NotFound):
            runs.get_run(session, "missing")


records = st.lists(
    st.tuples(st.sampled_from(["k1", "k2", "k3"]), st.integers(0, 6), st.integers(1, 500)), min_size=1, max_size=25
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seen=records, order=st.randoms(use_true_random=False))
def test_any_order_and_repetition_of_records_gives_the_same_total(tmp_path_factory, seen, order):
    """Property: crediting depends on the set of (peer, epoch) records, not on how often or in what order."""
    truth = {}
    for peer, epoch, samples in seen:
        truth.setdefault((peer, epoch), samples)  # a record's content for (peer, epoch) never changes
    batches = [signed(peer, f"user-{peer}", contribution(epoch, truth[(peer, epoch)])) for peer, epoch, _ in seen]
    replayed = batches + order.sample(batches, len(batches))
    order.shuffle(replayed)

    url = f"sqlite:///{tmp_path_factory.mktemp('prop') / 'db.sqlite3'}"
    migrate(url)
    from app.db import make_sessionmaker

    engine = make_engine(url)
    with make_sessionmaker(engine)() as session:
        run = runs.create_run(session, slug="prop", title="Prop")
        for start in range(0, len(replayed), 3):
            credit_contributions(session, run, replayed[start : start + 3])
        assert samples_total(session, run) == sum(truth.values())
    engine.dispose()
