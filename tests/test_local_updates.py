"""Local updates (DiLoCo) for real: portal, coordinator and workers as separate processes on loopback, one of them in
client mode, one joining mid-phase, one killed in an inner phase."""

from __future__ import annotations

import json
import re
import statistics
import tarfile

import httpx
import pytest
import torch
from dedloc_common.contract import LOOPBACK_OPTIMIZER

from app.cli.demo import DEMO_MODEL, write_corpus
from tests.support.harness import local_epoch, wait_for

pytestmark = pytest.mark.swarm

# 60 mini-batches of 16 across the swarm between outer rounds: a few seconds of compute, well above a round's time
OUTER_BATCH = 960
LAST_EPOCH = 10
TASK = {"model": DEMO_MODEL, "data": {"files": ["train.txt"], "eval_files": ["eval.txt"]},
        "tokenizer": {"train": {"vocab_size": 2000}}, "sequence_length": 64, "eval_samples": 48}
OPTIMIZER = {**LOOPBACK_OPTIMIZER, "name": "lamb", "lr": 0.01, "averaging_timeout": 8.0, "next_chunk_timeout": 3.0,
             "algorithm": "local-updates", "outer_batch_size": OUTER_BATCH,
             # DiLoCo's momentum of 0.9 amplifies a pseudo-gradient about tenfold over the rounds, which suits its
             # hundreds of inner steps a round; twenty here
             "outer_momentum": 0.5}
# fp16 pseudo-gradients: each peer adds the average's rounding relative to its own part (hivemind sends deltas), so
# outer parameters agree to about fp16's precision of a pseudo-gradient, not bit for bit
AGREEMENT = 2e-3


def claims(deployment, name: str) -> list[dict]:
    return deployment.report(name)["contributions"]


def test_three_workers_train_in_outer_rounds_and_are_credited_each_sample_once(deployment, tmp_path):
    train, held_out = write_corpus(tmp_path / "corpus")
    created = deployment.cli("create-run", deployment.slug, "--task", "masked-lm", "--task-options", json.dumps(TASK),
                             "--file", str(train), "--file", str(held_out), "--target-batch-size", "64",
                             "--batch-size", "16", "--optimizer", json.dumps(OPTIMIZER),
                             "--checkpoints", json.dumps({"every_epochs": 3, "keep": 10, "spot_check_rate": 0.5}))
    assert created.returncode == 0, created.stderr
    deployment.start_servers()
    deployment.start_worker("alice", "--max-epochs", str(LAST_EPOCH))
    deployment.wait_for_founder("alice")
    deployment.start_worker("bob", "--client", "--max-epochs", str(LAST_EPOCH))  # behind NAT: dials out only
    deployment.start_worker("mallory")  # killed in an inner phase below
    log = lambda name: (deployment.logs / f"{name}.log").read_text()  # noqa: E731
    # carol starts as soon as the others train together: her start takes a varying while on these shared cores
    wait_for(lambda: local_epoch(log("bob")) >= 1 and local_epoch(log("mallory")) >= 1, 180,
             "bob and mallory in outer rounds")
    deployment.start_worker("carol", "--max-epochs", str(LAST_EPOCH))  # joins mid-phase
    # Paused while she starts (here 15-20 s, in which the others once trained on to the last epoch without her): she
    # takes the outer state from the paused peers, and the three train from there.
    deployment.set_state("paused")
    wait_for(lambda: "the run is paused" in log("carol"), 120, "carol to join the paused run")
    deployment.set_state("active")
    # killed once carol is in the rounds, so that alice's parts have another full peer to confirm them after the kill
    wait_for(lambda: local_epoch(log("carol")) >= local_epoch(log("alice")) - 1 >= 3, 120, "carol in the rounds")
    killed_at = local_epoch(log("alice"))
    deployment.kill("mallory")  # SIGKILL mid-phase: its share of the next round is lost, the round goes on
    deployment.reap("mallory")
    for name in ("alice", "bob", "carol"):
        assert deployment.wait_exit(name, 240) == 0, log(name)
    assert local_epoch(log("alice")) >= LAST_EPOCH > killed_at + 1  # rounds went on past the kill

    # Every peer holds the same outer parameters after the last round, the joiner too: it took the outer state mid-run
    # and stepped from the same base in every round since.
    states = {name: torch.load(deployment.workdir / f"{name}.pt") for name in ("alice", "bob", "carol")}
    for name in ("bob", "carol"):
        for key, tensor in states["alice"].items():
            scale = max(float(tensor.abs().max()), 1.0)
            gap = float((states[name][key] - tensor).abs().max())
            assert gap <= AGREEMENT * scale, f"{name}'s {key} is {gap} from alice's"

    # The joiner started from the newest outer state, past the first round (the others trained to epoch 1 at least
    # before she started), and claims nothing before it.
    took = re.search(r"took the swarm's outer state: epoch (\d+)", log("carol"))
    carol = [c for c in claims(deployment, "carol") if c["samples"]]
    assert took and int(took[1]) >= 2, log("carol")
    assert carol and carol[0]["epoch"] >= int(took[1]), (carol, log("carol"))

    # The loss falls over the rounds.
    losses = [c["loss_sum"] / c["mini_steps"] for c in claims(deployment, "alice") if c["mini_steps"]]
    assert statistics.mean(losses[-3:]) < losses[0] - 0.3, losses  # 6.7 to 6.15 in a run here

    # Each honest peer's inner samples, as other users' aggregators confirmed them in the outer rounds, credited
    # once; the client-mode peer too. Unconfirmed: alice's rounds with no other full peer (bob, in client mode,
    # aggregates no part, so he confirms nobody's; how many depends on how fast the others start), and a round around
    # the kill at most (the killed peer aggregated a share of it and never published what it saw).
    def decided() -> bool:
        credit, recorded = deployment.credit_by_user(), deployment.claims_in_database()
        return all(sum(credit.get(name, (0, 0))) >= sum(c["samples"] for c in claims(deployment, name)) and
                   all((name, c["epoch"]) in recorded for c in claims(deployment, name))
                   for name in ("alice", "bob", "carol"))

    wait_for(decided, 60, "the coordinator to decide every claim")

    # Outer rounds came when the swarm's samples reached the outer batch: the samples each phase trained (mini-steps of
    # 16), whether its round averaged them in or a peer missed it (hivemind counts the swarm's reports: a round may
    # begin a mini-step or a report early, or later). The killed peer's published claims count too; its last ones
    # died with it, as a split round once showed (two groups in one round: the lineage check brought them back)
    trained = {epoch: steps * 16 for epoch, steps in deployment.mini_steps_by_epoch().items()}
    assert len(trained) >= LAST_EPOCH, trained
    assert 0.75 * OUTER_BATCH <= statistics.median(trained.values()) <= 1.5 * OUTER_BATCH, trained
    credit = deployment.credit_by_user()
    for name in ("alice", "bob", "carol"):
        claimed = sum(c["samples"] for c in claims(deployment, name))
        credited, held = credit[name]
        assert credited + held == claimed, (name, credit[name], claimed)
    rows = deployment.claim_rows()
    held = [row for row in rows if row["held"] and row["username"] != "mallory"]
    assert all("not confirmed" in row["reason"] for row in held), held
    # rounds another full peer averaged in ("": a claim whose round did not form names none)
    full_peers = {row["group"] for row in rows if row["username"] in ("mallory", "carol") and row["samples"]} - {""}
    lost = [row for row in held if row["group"] in full_peers]
    assert sum(row["held"] for row in lost) <= OUTER_BATCH, (credit, held)  # one round's share at most
    assert credit["bob"][0] > 0

    # Each claim says how long its peer computed and what it sent in the round: the progress API shows, per peer and
    # round, the bytes sent per sample averaged in and the share of the time spent computing
    progress = httpx.get(f"{deployment.url}/api/v1/runs/{deployment.slug}/progress").raise_for_status().json()
    shown = [peer for outer_round in progress["recent_rounds"] for peer in outer_round["peers"]]
    assert shown and all(0 < peer["compute_share"] <= 1 for peer in shown), shown
    assert all(peer["bytes_per_sample"] > 0 for peer in shown), shown
    assert all(count == 1 for _, _, count in deployment.rows_per_epoch())

    # The checkpoints hold the outer parameters and the outer momentum, and load with from_pretrained.
    from transformers import AutoModelForMaskedLM

    stored = httpx.get(f"{deployment.url}/api/v1/runs/{deployment.slug}/checkpoints").raise_for_status().json()
    assert stored, "no checkpoint"
    newest = max(stored, key=lambda c: c["epoch"])
    archive = tmp_path / "checkpoint.tar"
    archive.write_bytes(httpx.get(newest["url"]).raise_for_status().content)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "model", filter="data")
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "model")
    state = torch.load(tmp_path / "model" / "training_state.pt", weights_only=True)
    assert state["outer"]["rounds"] >= 1 and any(float(m.abs().sum()) > 0 for m in state["outer"]["momentum"])
    loaded = dict(model.named_parameters())
    assert any(torch.equal(p, saved) for p, saved in zip(loaded.values(), state["parameters"]))
    assert deployment.spot_checks() == 0, "local updates are not spot-checked, nor their draws held"
