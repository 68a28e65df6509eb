"""Poisoning in a real swarm of four (three honest peers, one attacker), each a separate process training with the
worker's own optimizer (``swarm.create_optimizer``: hivemind's Optimizer, dedloc's gradient and state averagers,
the run's default aggregation, tau, iterations and state-averaging period): for every attack, on gradients or on
the parameters of state rounds, the honest peers' model ends near where an all-honest run ends with robust
aggregation on, and past that bound with the plain mean (the control that the attack harms); the aggregators name
the attacker.

The four processes start once and run every scenario in turn, each from the same zero parameters
(tests/support/actors/poisoner.py; the schedule is the JSON file below).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
import uuid

import pytest
from dedloc_common.contract import STATE_EVERY

from app.core.processes import spawn, stop_all
from tests.support.actors import POISONER
from tests.support.harness import TAG, tagged_processes, wait_for

pytestmark = pytest.mark.swarm

BATCH, COMPUTE_SECONDS, BATCHES_PER_EPOCH, PEERS = 32, 0.3, 3, 4
EPOCHS = STATE_EVERY // 2  # every other scenario of an optimizer holds one state round, at its last epoch
GRADIENT_ATTACKS = ("x1000", "flip", "nan", "weight")
STATE_ATTACKS = ("state-x1000", "state-nan")
# Per optimizer, the k-th scenario runs its epochs [k * EPOCHS, (k + 1) * EPOCHS): odd k end on a state round. The
# first lets matchmaking settle (a peer's first rounds formed in twos). Each slot runs a scenario on both optimizers.
ORDER = ("warm-up", "state-x1000", "honest", "state-nan", "flip", "x1000", "weight", "nan")


def slots() -> list:
    return [[{"name": name + suffix, "attack": None if name in ("honest", "warm-up") else name,
              "aggregation": aggregation, "until": (k + 1) * EPOCHS}
             for aggregation, suffix in (("centered_clip", ""), ("mean", "-mean"))]
            for k, name in enumerate(ORDER)]


SCHEDULE = {
    "seed": 13, "dim": 16, "batch": BATCH, "lr": 0.3, "compute_seconds": COMPUTE_SECONDS,
    "batches_per_epoch": BATCHES_PER_EPOCH, "attacker": 3, "scenario_timeout": 60.0, "matchmaking_time": 1.0,
    # The organizer's ceiling: the rate a peer sustains, 2/3 of what it computes (a batch per compute time; it waits
    # for rounds the rest). An honest weight (a batch per 0.3 s of its epoch) stays under the cap, which adds one
    # matchmaking time; the attacker's 100x is capped at about 1.7x an honest one (3 batches in a 1.8 s epoch).
    "ceiling": BATCH / COMPUTE_SECONDS * 2 / 3,
    "slots": slots(),
}
# The loss at the start (zero parameters) is |truth|^2, about 16 here; five Adam steps (lr 0.3) bring an all-honest
# run to about 1.3. A bounded attacker still biases each round by up to tau times its weight share, and late in
# training Adam turns a small bias into a full step: the honest end loss may rise by at most 10% of the starting
# loss (docs/averaging.md#robust-aggregation, measured); the plain mean must end past that same bound under every
# attack.
START, MARGIN_OF_START = 16.0, 0.1


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """Start the four peers, wait for them to finish the schedule; yield (results by index, attacker's PeerID)."""
    folder = tmp_path_factory.mktemp("poisoning")
    schedule = folder / "schedule.json"
    schedule.write_text(json.dumps(SCHEDULE))
    tag, procs = uuid.uuid4().hex, []
    env = {TAG: tag}

    def start(index: int, *peers: str):
        procs.append(spawn([sys.executable, str(POISONER), str(schedule), str(index), str(folder / f"{index}.json"),
                            *peers], log=folder / f"{index}.log", env=env))

    try:
        start(0)
        address = folder / "0.json.addr"
        wait_for(address.exists, 60, "the first peer's address")
        time.sleep(0.2)  # written, then closed
        for index in range(1, 4):
            start(index, *json.loads(address.read_text()))
        deadline = time.monotonic() + 240
        for proc in procs:
            proc.wait(max(deadline - time.monotonic(), 1))
        logs = "\n".join((folder / f"{i}.log").read_text()[-2000:] for i in range(4))
        assert all(proc.returncode == 0 for proc in procs), logs
        results = [json.loads((folder / f"{i}.json").read_text()) for i in range(4)]
        yield results
    finally:
        stop_all(procs, grace=3)
        deadline = time.monotonic() + 5  # hivemind's p2pd leaves on its own once its parent is gone
        while tagged_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = tagged_processes(tag)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes {left} of the poisoning swarm outlived it"


def scenario(results, index: int, name: str) -> dict:
    return next(s for s in results[index]["scenarios"] if s["name"] == name)


def honest_losses(results, name: str) -> list:
    return [scenario(results, i, name)["loss"] for i in range(3)]


def bound(results) -> float:
    """The most an honest peer's loss may end at under attack with robust aggregation; the plain mean ends past it.
    The honest run is the worse of the two all-honest scenarios: one alone ended anywhere in 1.26-1.94 over runs
    (which rounds formed in twos), and a lucky 1.26 put the bound under an attack's ordinary 2.9."""
    return max(honest_losses(results, "honest") + honest_losses(results, "honest-mean")) + MARGIN_OF_START * START


def test_every_scenario_ran_its_epochs_on_every_peer(swarm):
    """A control: each scenario trained as planned (its state round included) on all four peers. That the
    attacker's parts reached the reducers shows in the attestations (robust) and the harm (plain mean) below."""
    for planned in (scenario for slot in SCHEDULE["slots"] for scenario in slot):
        for i in range(4):
            ran = scenario(swarm, i, planned["name"])
            assert ran["start"] == planned["until"] - EPOCHS and ran["end"] == planned["until"], \
                (planned["name"], i, ran["start"], ran["end"])


def test_all_honest_the_model_learns_and_the_defence_costs_little(swarm):
    losses = honest_losses(swarm, "honest")
    assert all(loss is not None and loss < 0.15 * START for loss in losses), losses
    plain = max(honest_losses(swarm, "honest-mean"))
    assert all(loss <= plain + MARGIN_OF_START * START for loss in losses), (losses, plain)


@pytest.mark.parametrize("attack", GRADIENT_ATTACKS + STATE_ATTACKS)
def test_with_robust_aggregation_the_honest_model_stays_near_the_honest_run(swarm, attack):
    losses = honest_losses(swarm, attack)
    assert all(loss is not None and loss <= bound(swarm) for loss in losses), (attack, losses, bound(swarm))


def harmed(swarm, attack: str) -> bool:
    losses = honest_losses(swarm, f"{attack}-mean")
    return all(loss is None or not math.isfinite(loss) or loss > bound(swarm) for loss in losses)


@pytest.mark.parametrize("attack", GRADIENT_ATTACKS)
def test_with_the_plain_mean_the_same_attack_ends_past_that_bound(swarm, attack):
    """The control for each gradient attack: the same rounds with hivemind's weighted mean are harmed."""
    assert harmed(swarm, attack), (attack, honest_losses(swarm, f"{attack}-mean"), bound(swarm))


def test_with_the_plain_mean_a_poisoned_state_round_ends_past_that_bound(swarm):
    """The control for the state attacks: a scenario holds one state round, which now and then forms without the
    attacker (one fresh-clone run's state-nan ended at the honest 1.5 with the plain mean, no NaN having reached it);
    the state attacks share their mechanism, and at least one of the two must have harmed the plain mean."""
    assert any(harmed(swarm, attack) for attack in STATE_ATTACKS), \
        ({attack: honest_losses(swarm, f"{attack}-mean") for attack in STATE_ATTACKS}, bound(swarm))


@pytest.mark.parametrize("attack", GRADIENT_ATTACKS)
def test_the_aggregators_name_the_attacker(swarm, attack):
    """hivemind gives the 16 values to one aggregator per round (never the attacker, which announces no bandwidth):
    the honest ones together name the attacker in most rounds, for what it did."""
    attacker = swarm[SCHEDULE["attacker"]]["peer_id"]
    rounds = [scenario(swarm, index, attack)["attested"] for index in range(3)]
    named = [[notes[attacker] for notes in per_round if attacker in notes] for per_round in zip(*rounds)]
    assert sum(bool(notes) for notes in named) >= EPOCHS // 2 + 1, named
    notes = [note for per_round in named for note in per_round]
    if attack == "nan":
        assert all(note["dropped"] >= 1 for note in notes)
    elif attack == "weight":  # 100x capped to about 1.7x, in the rounds it lied in (all but a scenario's first)
        inflated = [note for note in notes if note["weight"] > 10 * BATCH * BATCHES_PER_EPOCH * PEERS]
        assert len(inflated) >= EPOCHS // 2 and all(note["used"] < note["weight"] / 10 for note in inflated), notes
    else:
        assert any(note["clipped"] >= 1 and note["kept"] < 1.0 for note in notes)
    honest_ids = {swarm[i]["peer_id"] for i in range(3)}
    for index in range(4):  # the honest senders are never dropped
        for notes in scenario(swarm, index, attack)["attested"]:
            for peer, note in notes.items():
                if peer in honest_ids:
                    assert note["dropped"] == 0, (peer, note)
