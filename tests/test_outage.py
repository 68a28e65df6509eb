"""Coordinators on one database, then none for longer than a metrics record lives: when one comes back, every claim
made meanwhile is credited once, exactly as the workers' own reports say (portal, coordinators and workers as
processes on loopback)."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.support.harness import local_epoch, wait_for
from tests.test_swarm import confirmed_truth

pytestmark = pytest.mark.swarm
TTL = 8  # seconds a metrics record (and an acknowledgement) lives without being republished


def test_two_coordinators_on_one_database_then_none_for_longer_than_records_live_neither_lose_nor_double_credit(
        deployment):
    """Two coordinators credit one swarm from one database; then one crashes and the other stops. The workers train
    on, then the run is paused, so no epoch closes and nothing but the workers' claim keepers republishes their
    records, for longer than a record lives. The restarted coordinator records every claim made during the outage while
    the run is still paused (a record that had expired would have taken them with it), and in the end the database
    holds exactly the claims of the workers' --report files, each once, and credits what the other workers' receipts
    confirm. Also the auxiliary role: dave trains nothing, aggregates his share, and his receipts count."""
    deployment.env.update({"DEDLOC_METRICS_TTL": str(TTL), "DEDLOC_PLAN_INTERVAL": "0",
                           "DEDLOC_SECRET_KEY": "a-secret-shared-by-every-process-of-this-deployment"})
    trainers, workers = ["alice", "bob"], ["alice", "bob", "dave"]
    deployment.create_run()
    # Credit here must match the workers' receipts, which know no ceiling: an organizer's, far above any rate on
    # this machine, so that the derived one (which follows the confirmed claims as they arrive) cuts nothing
    deployment.set_ceiling(1e5)
    deployment.start_portal(wait=False)
    deployment.start_coordinator()
    # a second coordinator, elsewhere, on the same database (started before the workers: it starts faster)
    deployment.start("coordinator-second", "-m", "app.cli", "coordinator", "--run", deployment.slug,
                     env={"DEDLOC_DATA_DIR": str(deployment.workdir / "second"),
                          "DATABASE_URL": deployment.database_url})
    second_log = deployment.logs / "coordinator-second.log"
    deployment.wait_for_coordinator()
    wait_for(lambda: "listening at" in second_log.read_text(), 60, "the second coordinator")
    deployment.start_worker("alice", "--max-epochs", "60")
    deployment.wait_for_founder("alice")
    deployment.start_worker("bob", "--max-epochs", "60")
    deployment.start_worker("dave", "--aux", "--max-epochs", "60")
    wait_for(lambda: deployment.swarm()["peers_online"] >= 2, 90, "both trainers online")
    rows = len(deployment.rows_per_epoch())
    wait_for(lambda: len(deployment.rows_per_epoch()) >= rows + 6, 60, "epochs credited while both coordinators run")

    # No coordinator: one crashes (no goodbye, children reaped as its supervisor would), one stops.
    deployment.kill("coordinator")
    deployment.reap("coordinator")
    assert deployment.stop("coordinator-second", grace=30) == 0
    down_at = max(epoch for _, epoch in deployment.claims_in_database())
    wait_for(lambda: all(local_epoch((deployment.logs / f"{name}.log").read_text()) >= down_at + 3
                         for name in trainers),
             60, "the workers to train on: a few epochs nobody records")
    deployment.set_state("paused")
    time.sleep(TTL + 4)  # paused: nothing closes an epoch; a record not kept alive would be gone by now
    assert all(deployment.processes[name].poll() is None for name in workers), "a worker ended early"

    deployment.start_coordinator("coordinator-restarted")
    wait_for(lambda: max(epoch for _, epoch in deployment.claims_in_database()) >= down_at + 2, 90,
             "the restarted coordinator to record the epochs trained while it was down")
    time.sleep(4)  # every record read at least once more
    while_paused = deployment.claims_in_database()

    deployment.set_state("active")
    paused_epoch = max(epoch for _, epoch in while_paused)
    paused_at = {name: max(epoch for user, epoch in while_paused if user == name) for name in trainers}
    # The pause stopped each trainer wherever it was in its epoch: the round of its last epoch ran into the pause,
    # and the rounds of the epoch it was in and the next one ran while the two realigned, each without the other
    # when they had stopped at different points (up to three such rounds in one run). Rounds are counted outside them.
    cut = {epoch for name in trainers for epoch in range(paused_at[name], paused_at[name] + 3)}

    def recorded() -> dict[str, list[int]]:
        claims = deployment.claims_in_database()
        return {name: sorted(e for (user, e), samples in claims.items() if user == name and samples)
                for name in trainers}

    def trained_on() -> bool:  # training went on, and the trainers shared enough epochs to count failed rounds
        epochs = recorded()
        shared = (set(epochs["alice"][1:]) & set(epochs["bob"][1:])) - cut
        return epochs["alice"][-1] >= paused_epoch + 3 and len(shared) >= 10

    def how_things_stand() -> str:
        tails = {name: (deployment.logs / f"{name}.log").read_text()[-1500:] for name in trainers}
        return (f"training to go on after the pause (at {paused_at}, cut {sorted(cut)}), ten epochs shared by both "
                f"trainers; epochs with samples recorded: {recorded()}; the trainers' logs end: {tails}")

    wait_for(trained_on, 180, how_things_stand)
    # The pause was no training time: the rate each trainer reports after it is of the order of the one before it
    # (counted, the pause cut it to a thirtieth)
    for name in trainers:
        before, after = (deployment.logs / f"{name}.log").read_text().split("\ntraining resumes\n", 1)
        rate = lambda text: [int(r) for r in re.findall(r"\| (\d+) samples/s here", text)]  # noqa: E731
        assert rate(after)[0] > rate(before)[-1] / 3, (name, rate(before)[-3:], rate(after)[:3])
    assert all(deployment.processes[name].poll() is None for name in workers), "a worker ended early"
    for name in workers:  # volunteers leave with Ctrl-C
        deployment.processes[name].send_signal(signal.SIGINT)
    for name in workers:  # a round in flight gets LEAVE_GRACE, then is cancelled (timed by bench.leave)
        assert deployment.wait_exit(name, timeout=60) == 0, (deployment.logs / f"{name}.log").read_text()[-3000:]

    reports = {name: deployment.report(name)["contributions"] for name in workers}
    reported = {(name, c["epoch"]): c["samples"] for name in workers for c in reports[name]}
    assert {key: samples for key, samples in reported.items()
            if key[0] in trainers and key[1] <= paused_at[key[0]]} == {
        key: samples for key, samples in while_paused.items() if key[0] in trainers}
    wait_for(lambda: deployment.claims_in_database() == reported, 30, "every reported claim in the database")
    assert all(count == 1 for _, _, count in deployment.rows_per_epoch())
    truth = confirmed_truth(deployment, workers)
    assert truth["alice"][0] and truth["bob"][0], truth
    wait_for(lambda: deployment.credit_by_user() == truth, 60, f"credit to match the workers' receipts {truth}")
    # dave aggregated parts of the trainers' gradients, as the plan's auxiliary peer, and claimed no samples
    assert any(c["aggregated"] for c in reports["dave"]) and not any(c["samples"] for c in reports["dave"])
    # Rounds form: of the epochs both trainers took part in from start to end (not one's first, joined midway, nor
    # its last, left midway) and that the pause did not cut into, few went into no averaging round (a count: on
    # shared cores a round can still miss its group now and then; each such epoch is one line in the worker's output).
    trained = {name: sorted(c["epoch"] for c in reports[name] if c["samples"]) for name in trainers}
    both = (set(trained["alice"][1:-1]) & set(trained["bob"][1:-1])) - cut
    alone = [(name, c["epoch"]) for name in trainers for c in reports[name] if c["epoch"] in both and not c["group"]]
    assert len(both) >= 8 and len(alone) <= max(2, len(both) // 10), (len(both), alone)
    # and some plan named him as auxiliary (the current one may not: a plan is replaced only when 5% faster)
    roles = [{peer["username"]: peer["role"] for peer in plan} for plan in deployment.plans()]
    assert any(named.get("dave") == "aux" for named in roles), roles
    # Both coordinators wrote to one healthy database: where they raced on a row, that is no outage and not called one
    for name in ("coordinator", "coordinator-second"):
        assert "database unavailable" not in (deployment.logs / f"{name}.log").read_text()
