"""A run's progress to its target: steps done, time left with a range from the throughput's spread, and the share
of recent rounds that did not form."""

from __future__ import annotations

from datetime import timedelta

from fastapi.testclient import TestClient

from app.core.clock import utcnow
from app.core.config import Settings
from app.models import Contribution, Snapshot
from app.runs import registry
from app.runs.progress import run_progress
from app.web.main import create_app


def snapshot(run, epoch: int, speed: float, seconds_ago: float) -> Snapshot:
    return Snapshot(run_id=run.id, taken_at=utcnow() - timedelta(seconds=seconds_ago), peers_online=2,
                    samples_per_second=speed, epoch=epoch, loss=1.0, samples_total=0, samples_accumulated=0)


def claim(run, epoch: int, peer: str, group: str) -> Contribution:
    return Contribution(run_id=run.id, peer_key=peer, epoch=epoch, username=peer, samples=100, loss_sum=1.0,
                        mini_steps=1, seconds=1.0, group_id=group)


def test_time_left_has_a_range_from_the_throughputs_quartiles(sessions, database_url, tmp_path):
    with sessions() as session:
        run = registry.create_run(session, slug="goal", title="Goal", target_batch_size=1000, batch_size=10,
                                  target_epochs=20)
        # Throughput 100, 200, 300, 400 samples/s (quartiles 125 and 375, statistics.quantiles' default), epoch 10.
        session.add_all([snapshot(run, 10, speed, 10 - i) for i, speed in enumerate([100, 200, 300, 400])])
        session.add_all([claim(run, e, p, "" if (e, p) == (9, "b") else f"g{e}") for e in (8, 9) for p in "ab"])
        session.commit()
        progress = run_progress(session, run)
        remaining = (20 - 10) * 1000
        assert (progress.epoch, progress.target_epochs, progress.fraction_done) == (10, 20, 0.5)
        assert progress.eta_seconds == round(remaining / 250, 1)
        assert progress.eta_low_seconds < progress.eta_seconds < progress.eta_high_seconds
        assert progress.eta_low_seconds == round(remaining / 375, 1)
        assert progress.eta_high_seconds == round(remaining / 125, 1)
        assert (progress.rounds_not_formed, progress.claims_recent) == (1, 4)

        registry.set_state(session, run, "finished")
        done = run_progress(session, run)
        assert (done.state, done.fraction_done, done.eta_seconds) == ("finished", 1.0, 0.0)

    with TestClient(create_app(Settings(database_url=database_url, data_dir=tmp_path))) as client:
        answer = client.get("/api/v1/runs/goal/progress").json()
        page = client.get("/runs/goal").text
    assert answer["state"] == "finished" and answer["rounds_not_formed"] == 1
    assert "Finished" in page and "1 of the last 4 peer-steps" in page


def test_a_run_without_a_target_has_no_eta(sessions):
    with sessions() as session:
        run = registry.create_run(session, slug="open", title="Open")
        session.add(snapshot(run, 3, 100.0, 1))
        session.commit()
        progress = run_progress(session, run)
    assert progress.target_epochs is None and progress.eta_seconds is None and progress.fraction_done is None


def test_the_progress_and_the_dashboard_name_the_training_algorithm(sessions, database_url, tmp_path):
    with sessions() as session:
        local_run = registry.create_run(session, slug="dil", title="DiLoCo", target_batch_size=256, batch_size=16,
                                        optimizer={"algorithm": "local-updates"}, target_epochs=12)
        registry.create_run(session, slug="big", title="Large", target_batch_size=256, batch_size=16)
        # two outer rounds; an epoch is an outer round of 16,384 samples by default, so 10 left at 2,048 samples/s
        # take 80 s
        session.add(snapshot(local_run, 2, 2048.0, 1))
        session.add_all([Contribution(run_id=local_run.id, peer_key=name, epoch=epoch, username=name, samples=samples,
                                      loss_sum=1.0, mini_steps=samples // 16, seconds=8.04, group_id=f"g{epoch}",
                                      compute_seconds=compute, sent_bytes=sent)
                         for epoch in (0, 1)
                         for name, samples, compute, sent in (("ann", 6144, 6.03, 614_400), ("ben", 2048, None, None))])
        session.commit()
    with TestClient(create_app(Settings(database_url=database_url, data_dir=tmp_path))) as client:
        local = client.get("/api/v1/runs/dil/progress").json()
        assert (local["algorithm"], local["outer_batch_size"]) == ("local-updates", 64 * 256)
        assert local["eta_seconds"] == 80.0
        assert [r["epoch"] for r in local["recent_rounds"]] == [1, 0]
        assert local["recent_rounds"][0]["peers"] == [
            {"username": "ann", "inner_steps": 384, "samples": 6144, "seconds": 8.0, "bytes_per_sample": 100.0,
             "compute_share": 0.75},
            # a worker that did not report them
            {"username": "ben", "inner_steps": 128, "samples": 2048, "seconds": 8.0, "bytes_per_sample": None,
             "compute_share": None}]
        page = " ".join(client.get("/runs/dil").text.split())
        assert "an outer round every 16,384 samples" in page and "Outer round 2 of 12" in page
        assert "<td>1</td><td>ann</td><td>384</td> <td>6,144</td><td>8.0</td> <td>100.0</td> <td>75%</td>" in page
        assert "<td>1</td><td>ben</td><td>128</td> <td>2,048</td><td>8.0</td> <td>-</td> <td>-</td>" in page
        large = client.get("/api/v1/runs/big/progress").json()
        assert (large["algorithm"], large["outer_batch_size"], large["recent_rounds"]) == ("large-batch", None, [])
        assert "one optimizer step every 256 samples" in " ".join(client.get("/runs/big").text.split())
