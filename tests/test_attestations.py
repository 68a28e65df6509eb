"""Aggregators' attestations (robust aggregation) on a real database (SQLite and PostgreSQL) and the real app:
stored on the receipts by the coordinator's settlement, shown on the run's dashboard and to the sender on /me."""

from __future__ import annotations

from dedloc_common.contract import Attestation
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.credit import attestations
from app.credit.settlement import credit_epochs
from app.web.main import create_app
from tests.support.credit import Peer, aged_run, claim
from tests.test_contribution_pages import sign_in

CLIPPED = Attestation(parts=3, weight=32.0, used=32.0, dropped=0, clipped=2, kept=0.0123)
CAPPED_AND_DROPPED = Attestation(parts=3, weight=3200.0, used=57.0, dropped=1, clipped=0, kept=1.0)


def test_attestations_are_stored_and_shown_on_the_dashboard_and_to_the_sender(sessions, database_url, tmp_path):
    with sessions() as session:
        run = aged_run(session, "robust")
        alice, mallory = Peer(session, run, "alice", tmp_path, 0), Peer(session, run, "mallory", tmp_path, 1)
        aggregated = {"g1": {alice.peer_id: 32.0, mallory.peer_id: 3200.0}}
        first = claim(1, 32, "g1", aggregated, members=[alice.peer_id, mallory.peer_id])
        # the attestation of round g1 arrives with alice's next epoch (it can close after the receipt's)
        later = claim(2, 32, "g2").copy(update={"attested": {"g1": {mallory.peer_id: CAPPED_AND_DROPPED},
                                                                "g0": {mallory.peer_id: CLIPPED}}})
        credit_epochs(session, run, [alice.record(first)])
        assert attestations.recent_cuts(session, run) == []  # a control: nothing attested yet
        credit_epochs(session, run, [alice.record(first, later)])
        cuts = attestations.recent_cuts(session, run)
        assert {(c.group, c.sender, c.aggregator, c.dropped, c.clipped, c.used) for c in cuts} == {
            ("g1", "mallory", "alice", 1, 0, 57.0), ("g0", "mallory", "alice", 0, 2, 32.0)}
        assert [c.sender for c in attestations.own_cuts(session, "mallory")] == ["mallory", "mallory"]
        assert attestations.own_cuts(session, "alice") == []

    app = create_app(Settings(database_url=database_url, data_dir=tmp_path))
    with TestClient(app) as client:
        page = client.get("/runs/robust").text
        assert "weight capped from 3,200 to 57 samples by the run&#39;s ceiling" in page
        assert "1 of 3 parts dropped (not finite)" in page and "2 of 3 parts clipped (at least 1.2%" in page
        mine = sign_in(client, "mallory").get("/me").text
        assert "weight capped from 3,200 to 57 samples" in mine and "alice" in mine
    with TestClient(app) as other:
        assert "No aggregator cut anything" in sign_in(other, "alice").get("/me").text
        assert 'id="aggregation-mean"' not in other.get("/runs/robust").text
    with sessions() as session:
        aged_run(session, "plain", optimizer={"aggregation": "mean"})
    with TestClient(app) as client:
        assert "the plain weighted mean: no aggregator caps" in client.get("/runs/plain").text


def test_robust_aggregation_options_are_validated_like_the_others(sessions):
    import pytest

    from app.core.errors import Invalid
    from app.runs import registry

    with sessions() as session:
        run = registry.create_run(session, slug="opts", title="Opts", optimizer={"clip_radius": 2.5})
        config = registry.run_config(run)
        assert (config.optimizer.aggregation, config.optimizer.clip_radius) == ("centered_clip", 2.5)  # on by default
        assert config.samples_per_second_ceiling == run.samples_per_second_ceiling  # the cap's ceiling reaches workers
        for bad, words in (({"aggregation": "median"}, "optimizer.aggregation"),
                           ({"clip_radius": 0}, "optimizer.clip_radius"),
                           ({"clip_radius": "nan"}, "optimizer.clip_radius"),
                           ({"clip_iterations": 0}, "optimizer.clip_iterations")):
            with pytest.raises(Invalid, match=words):
                registry.create_run(session, slug="bad", title="Bad", optimizer=bad)
        plain = registry.create_run(session, slug="plain", title="Plain", optimizer={"aggregation": "mean"})
        assert registry.run_config(plain).optimizer.aggregation == "mean"


def test_a_full_claim_outbox_sheds_attestations_before_any_claim():
    """Attestations are evidence, claims are credit: a coordinator outage long enough to fill the worker's claim
    outbox costs the oldest claims' attestations first."""
    import time

    from dedloc_common.contract import EpochContribution, MetricsRecord
    from dedloc_worker.claims import ClaimOutbox

    notes = {f"g{i}": {f"QmSender{j}": CLIPPED for j in range(8)} for i in range(2)}
    claims = [EpochContribution(epoch=e, samples=10, loss_sum=1.0, mini_steps=1, seconds=1.0, attested=notes)
              for e in range(6)]
    bare = len(claims[0].copy(update={"attested": {}}).json())
    outbox = ClaimOutbox(held_bytes=6 * bare + 2 * (len(claims[0].json()) - bare))  # all claims, two attested
    for claim in claims:
        sent = outbox.outgoing(MetricsRecord(username="alice", epoch=9, samples_per_second=1.0, time=time.time(),
                                             recent=[claim]))
    assert [c.epoch for c in sent.recent] == list(range(6)) and outbox.dropped == 0
    assert [bool(c.attested) for c in sent.recent] == [False] * 4 + [True] * 2  # the newest keep theirs
