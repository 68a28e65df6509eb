"""Credit against ground truth in a real swarm, with workers patched to lie."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import wait_for
from tests.test_swarm import confirmed_truth


pytestmark = pytest.mark.swarm
LIAR = Path(__file__).with_name("liar.py")


def test_liars_excess_is_held_with_a_reason_and_honest_credit_is_unchanged(deployment):
    deployment.create_run(target_batch_size=3072)
    deployment.start_portal()
    deployment.start_coordinator()
    deployment.wait_for_coordinator()
    deployment.start_worker("alice", "--max-epochs", "8")
    wait_for(lambda: deployment.swarm()["epoch"] >= 1, 90, "alice to take the first step")
    # The organizer's ceiling: three times what one worker does alone on this machine. Sharing two cores, each
    # worker then runs at half to two thirds of that, so honest ones stay under it and 100x liars go over.
    ceiling = round(3 * deployment.swarm()["samples_per_second"])
    deployment.set_ceiling(ceiling)
    for name, mode in (("bob", "metrics"), ("carol", "both")):
        deployment.start_worker(name, "--max-epochs", "8", script=[str(LIAR), mode])
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
    # carol lied in her all-reduce weight too: receipts confirm the lie (or she averaged alone), the plausibility
    # ceiling does not.
    assert credit["carol"][1] > 0, credit
    assert any(f"ceiling is {ceiling:,}" in reason for reason in reasons["carol"]), (ceiling, reasons["carol"])
