"""Credit against ground truth in a real swarm, with workers patched to lie."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import wait_for
from tests.test_swarm import confirmed_truth


pytestmark = pytest.mark.swarm
LIAR = Path(__file__).with_name("liar.py")
CEILING = 1500  # samples/s per peer; honest workers here run at 300-900


def test_liars_excess_is_held_with_a_reason_and_honest_credit_is_unchanged(deployment):
    done = deployment.cli("create-run", deployment.slug, "--target-batch-size", "3072",
                          "--samples-per-second-ceiling", str(CEILING),
                          "--optimizer", '{"matchmaking_time": 1.0, "averaging_timeout": 10.0, "metadata_expiration": 10.0}')
    assert done.returncode == 0, done.stderr
    deployment.start_portal()
    deployment.start_coordinator()
    deployment.wait_for_coordinator()
    deployment.start_worker("alice", "--max-epochs", "5")
    wait_for(lambda: deployment.swarm()["epoch"] >= 1, 90, "alice to take the first step")
    for name, mode in (("bob", "metrics"), ("carol", "both")):
        deployment.start_worker(name, "--max-epochs", "5", script=[str(LIAR), mode])
    for name in ("alice", "bob", "carol"):
        assert deployment.wait_exit(name, timeout=240) == 0, (deployment.logs / f"{name}.log").read_text()[-2000:]

    claimed = {name: sum(c["samples"] for c in deployment.report(name)["contributions"]) for name in ("bob", "carol")}
    alice_truth = confirmed_truth(deployment, ["alice", "bob", "carol"])["alice"]
    wait_for(lambda: deployment.credit_by_user().get("alice") == alice_truth, 30, f"alice's credit {alice_truth}")
    wait_for(lambda: sum(deployment.credit_by_user().get("carol", (0, 0))) == claimed["carol"], 30, "carol's claims")
    credit, reasons = deployment.credit_by_user(), deployment.held_reasons()
    # bob lied in his record only: the aggregators saw his real weight, everything above it is held.
    assert sum(credit["bob"]) == claimed["bob"] and credit["bob"][0] * 10 <= claimed["bob"]
    assert any("the peers that averaged with it saw" in reason for reason in reasons["bob"]), reasons["bob"]
    # carol lied in her all-reduce weight too: receipts confirm the lie, the plausibility ceiling does not.
    assert credit["carol"][1] > 0, credit
    assert any(f"ceiling is {CEILING:,}" in reason for reason in reasons["carol"]), reasons["carol"]
