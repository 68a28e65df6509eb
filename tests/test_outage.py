"""A coordinator down for longer than a metrics record lives: when it comes back, every claim made meanwhile is
credited, exactly as the workers' own reports say (portal, coordinator and workers as processes on loopback)."""

from __future__ import annotations

import signal
import time

import pytest
from sqlalchemy import select

from app.core.database import make_engine, make_sessionmaker
from app.models import Contribution
from app.runs import registry
from tests.support.harness import local_epoch, wait_for
from tests.test_swarm import confirmed_truth

pytestmark = pytest.mark.swarm
TTL = 8  # seconds a metrics record (and an acknowledgement) lives without being republished


def claims_in_database(deployment) -> dict[tuple[str, int], int]:
    """(username, epoch) -> samples of every claim the coordinators recorded."""
    engine = make_engine(deployment.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            rows = session.execute(select(Contribution.username, Contribution.epoch, Contribution.samples))
            return {(username, epoch): samples for username, epoch, samples in rows}
    finally:
        engine.dispose()


def set_state(deployment, state: str) -> None:
    """What an organizer does on the organize page: pause or resume the run (workers follow within seconds)."""
    engine = make_engine(deployment.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            registry.set_state(session, registry.get_run(session, deployment.slug), state)
    finally:
        engine.dispose()


def test_a_coordinator_down_longer_than_records_live_credits_every_claim_when_it_returns(deployment):
    """The coordinator crashes; the workers train on, then the run is paused, so no epoch closes and nothing but
    the workers' claim keepers republishes their records, for three record lifetimes. The restarted coordinator
    records every claim made during the outage while the run is still paused (a record that had expired would
    have taken them with it), and in the end the database holds exactly the claims of the workers' --report
    files and credits what the other worker's receipts confirm."""
    deployment.env["DEDLOC_METRICS_TTL"] = str(TTL)
    workers = ["alice", "bob"]
    deployment.start_swarm(workers)
    wait_for(lambda: deployment.swarm()["peers_online"] == 2, 90, "both workers online")
    wait_for(lambda: {user for user, _ in claims_in_database(deployment)} == set(workers), 90,
             "claims of both workers")

    deployment.kill("coordinator")  # a crash: no goodbye; its children reaped as its supervisor would
    deployment.reap("coordinator")
    down_at = max(epoch for _, epoch in claims_in_database(deployment))
    wait_for(lambda: all(local_epoch((deployment.logs / f"{name}.log").read_text()) >= down_at + 3 for name in workers),
             60, "the workers to train on: a few epochs nobody records")
    set_state(deployment, "paused")
    time.sleep(3 * TTL + 6)  # paused: nothing closes an epoch; a record not kept alive would be gone
    assert all(deployment.processes[name].poll() is None for name in workers), "a worker ended early"

    deployment.start_coordinator("coordinator-restarted")
    wait_for(lambda: max(epoch for _, epoch in claims_in_database(deployment)) >= down_at + 2, 90,
             "the restarted coordinator to record the epochs trained while it was down")
    time.sleep(4)  # every record read at least once more
    while_paused = claims_in_database(deployment)

    set_state(deployment, "active")
    wait_for(lambda: max(epoch for _, epoch in claims_in_database(deployment)) >= max(
        epoch for _, epoch in while_paused) + 2, 90, "training to go on after the pause")
    for name in workers:  # volunteers leave with Ctrl-C
        deployment.processes[name].send_signal(signal.SIGINT)
    for name in workers:
        assert deployment.wait_exit(name, timeout=60) == 0, (deployment.logs / f"{name}.log").read_text()[-3000:]

    reported = {(name, c["epoch"]): c["samples"] for name in workers for c in deployment.report(name)["contributions"]}
    paused_at = {name: max(epoch for user, epoch in while_paused if user == name) for name in workers}
    assert {key: samples for key, samples in reported.items() if key[1] <= paused_at[key[0]]} == while_paused
    wait_for(lambda: claims_in_database(deployment) == reported, 30, "every reported claim in the database")
    truth = confirmed_truth(deployment, workers)
    assert all(credited for credited, _ in truth.values()), truth
    wait_for(lambda: deployment.credit_by_user() == truth, 30, f"credit to match the workers' receipts {truth}")
