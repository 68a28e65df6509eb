"""The collaboration for real: portal, coordinator and workers as separate processes on loopback."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from app.processes import group_members
from tests.harness import wait_for

pytestmark = pytest.mark.swarm


def reported_samples(deployment, username: str) -> int:
    return sum(c["samples"] for c in deployment.report(username)["contributions"])


def confirmed_truth(deployment, usernames: list[str]) -> dict[str, tuple[int, int]]:
    """From the workers' own reports: per user, (samples another worker saw it send, samples nobody confirmed).

    Worker A's claim is confirmed when another worker's report says it aggregated A's part in the same
    all-reduce round with the weight A claims: exactly what the coordinator must credit, computed without it.
    """
    reports = {name: deployment.report(name) for name in usernames}
    truth = {}
    for name, report in reports.items():
        credited = held = 0
        for claim in report["contributions"]:
            seen = [c["aggregated"].get(claim["group"], {}).get(report["peer_id"]) for other, r in reports.items()
                    if other != name for c in r["contributions"]] if claim["group"] else []
            weights = [w for w in seen if w is not None]
            if weights and int(min(weights)) >= claim["samples"]:
                credited += claim["samples"]
            else:
                held += claim["samples"]
        truth[name] = (credited, held)
    return truth


def epoch_losses(deployment, username: str) -> list[float]:
    return [c["loss_sum"] / c["mini_steps"] for c in deployment.report(username)["contributions"] if c["mini_steps"]]


def test_three_workers_train_one_model_and_every_sample_is_credited(deployment):
    workers = ["alice", "bob", "carol"]
    deployment.start_swarm(workers, "--max-epochs", "5")
    for name in workers:
        assert deployment.wait_exit(name, timeout=240) == 0, (deployment.logs / f"{name}.log").read_text()[-3000:]

    states = {name: torch.load(deployment.workdir / f"{name}.pt") for name in workers}
    worst = max((states["alice"][key] - states[name][key]).abs().max().item()
                for name in workers[1:] for key in states["alice"])
    assert worst < 1e-5, f"parameters differ by {worst}"

    for name in workers:
        assert deployment.report(name)["final_epoch"] >= 5
    # alice founded the run, so her first epoch is the collaboration's first; the others joined later.
    first, last = epoch_losses(deployment, "alice")[0], epoch_losses(deployment, "carol")[-1]
    assert last < first, f"the loss did not fall: {first} -> {last}"

    # Exact: the worker's report and the DHT record carry the same number, the weight hivemind averaged with.
    expected = {name: reported_samples(deployment, name) for name in workers}
    assert all(expected.values())
    wait_for(lambda: deployment.credited_by_user() == expected, 30, f"claims to reach {expected}")
    truth = confirmed_truth(deployment, workers)
    assert all(credited for credited, _ in truth.values()), f"a worker never averaged with another: {truth}"
    wait_for(lambda: deployment.credit_by_user() == truth, 30, f"credit to match the workers' receipts {truth}")

    swarm = deployment.swarm()
    assert swarm["samples_total"] == sum(credited for credited, _ in truth.values())
    assert swarm["epoch"] >= 5 and swarm["target_batch_size"] == 3072
    board = deployment.get(f"/api/v1/runs/{deployment.slug}/leaderboard")
    assert {row["username"]: row["samples"] for row in board} == {name: c for name, (c, _) in truth.items()}
    assert [row["samples"] for row in board] == sorted((c for c, _ in truth.values()), reverse=True)
    assert all(row["runtime_seconds"] > 0 for row in board)


def test_a_killed_worker_leaves_and_the_other_carries_on(deployment):
    deployment.start_swarm(["alice", "bob"])
    wait_for(lambda: deployment.swarm()["peers_online"] == 2 and deployment.swarm()["epoch"] >= 1, 120,
             "two peers online past epoch 1")

    bob = deployment.processes["bob"]
    deployment.kill("bob")
    orphans = group_members(bob.pid)
    assert orphans, "expected hivemind's children to outlive a SIGKILLed worker (hivemind-notes pitfall 3)"
    deployment.reap("bob")
    assert group_members(bob.pid) == []

    killed_at = time.monotonic()
    wait_for(lambda: deployment.swarm()["peers_online"] == 1, 30, "peers_online to drop to 1")
    print(f"peers_online dropped {time.monotonic() - killed_at:.1f} s after the kill")
    epoch = deployment.swarm()["epoch"]
    wait_for(lambda: deployment.swarm()["epoch"] >= epoch + 1, 90, "alice to carry on alone")
    assert deployment.processes["alice"].poll() is None


def test_two_coordinators_on_one_database_then_none_for_30_s_neither_lose_nor_double_credit(deployment):
    deployment.env["DEDLOC_SECRET_KEY"] = "a-secret-shared-by-every-process-of-this-deployment"
    deployment.start_swarm(["alice", "bob"], "--max-epochs", "60")
    wait_for(lambda: deployment.swarm()["peers_online"] == 2, 60, "both workers online")
    # a second coordinator, elsewhere, on the same database
    deployment.start("coordinator-second", "-m", "app.cli", "coordinator", "--run", deployment.slug,
                     env={"DEDLOC_DATA_DIR": str(deployment.workdir / "second"), "DATABASE_URL": deployment.database_url})
    second_log = deployment.logs / "coordinator-second.log"
    wait_for(lambda: "listening at" in second_log.read_text(), 60, "the second coordinator")
    rows = len(deployment.rows_per_epoch())
    wait_for(lambda: len(deployment.rows_per_epoch()) >= rows + 4, 60, "epochs credited while both coordinators run")

    # No coordinator for 30 s: one crashes (no goodbye, children reaped as its supervisor would), one stops.
    deployment.kill("coordinator")
    deployment.reap("coordinator")
    assert deployment.stop("coordinator-second", grace=30) == 0
    epoch_down = max(epoch for _, epoch, _ in deployment.rows_per_epoch())
    time.sleep(30)
    assert all(deployment.processes[name].poll() is None for name in ("alice", "bob")), "the workers ended early"
    deployment.start_coordinator("coordinator-restarted")
    # it rejoins the running swarm: epochs trained after the outage began reach the database while training goes on
    wait_for(lambda: max(epoch for _, epoch, _ in deployment.rows_per_epoch()) > epoch_down + 8, 60,
             "the restarted coordinator to credit epochs trained while it was down")
    assert all(deployment.processes[name].poll() is None for name in ("alice", "bob")), "the workers ended early"

    for name in ("alice", "bob"):  # volunteers leave with Ctrl-C: a round in flight may take its timeout (10 s)
        assert deployment.stop(name, signal.SIGINT, grace=30) == 0, (deployment.logs / f"{name}.log").read_text()[-3000:]
    expected = {name: reported_samples(deployment, name) for name in ("alice", "bob")}
    wait_for(lambda: deployment.credited_by_user() == expected, 45, f"claims to reach {expected}")
    truth = confirmed_truth(deployment, ["alice", "bob"])
    wait_for(lambda: deployment.credit_by_user() == truth, 30, f"credit to match the workers' receipts {truth}")
    assert all(count == 1 for _, _, count in deployment.rows_per_epoch())
