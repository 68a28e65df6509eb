"""Aggregators' attestations and receipts on a real database (SQLite and PostgreSQL) and the real app: stored on
the receipts by the coordinator's settlement, shown on the run's dashboard and to the sender on /me; credit counts
the weight a sender's parts carried in (real reducers fed real parts, through the worker's receipt log)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from dedloc_common.contract import Attestation, EpochContribution
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.credit import attestations
from app.credit.settlement import credit_epochs
from app.web.main import create_app
from tests.support.credit import Peer, aged_run, claim, totals
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
    from dedloc_worker.credit.outbox import ClaimOutbox

    notes = {f"g{i}": {f"QmSender{j}": CLIPPED for j in range(8)} for i in range(2)}
    claims = [EpochContribution(epoch=e, samples=10, loss_sum=1.0, mini_steps=1, seconds=1.0, attested=notes)
              for e in range(6)]
    bare = len(claims[0].copy(update={"attested": {}}).json())
    outbox = ClaimOutbox(held_bytes=6 * bare + 2 * (len(claims[0].json()) - bare))  # all claims, two attested
    for each in claims:
        sent = outbox.outgoing(MetricsRecord(username="alice", epoch=9, samples_per_second=1.0, time=time.time(),
                                             recent=[each]))
    assert [c.epoch for c in sent.recent] == list(range(6)) and outbox.dropped == 0
    assert [bool(c.attested) for c in sent.recent] == [False] * 4 + [True] * 2  # the newest keep theirs


# --- receipts cover every part: credit counts the weight the parts carried in -------------------------------------

ZEROS = Attestation(parts=2, weight=32.0, used=32.0, dropped=0, clipped=0, kept=1.0, expected=2, zeros=2)
NAN = Attestation(parts=2, weight=32.0, used=32.0, dropped=2, clipped=0, kept=1.0, expected=2, nonfinite=2)
HALF_LOST = Attestation(parts=1, weight=32.0, used=32.0, dropped=0, clipped=0, kept=1.0, expected=2)


def held_table(page: str) -> str:
    """The "Held back" table of a /me page."""
    return page[page.index('id="held"'):].split("</table>")[0]


def test_a_receipt_counts_only_what_its_aggregators_note_says_the_parts_carried(sessions, database_url, tmp_path):
    """Three honest aggregators (alice, bob, carol) each receive two parts from every sender, all sent with a
    plausible weight of 32 samples. mallory's are all zeros, nora's NaN, half of pete's never arrive. Their
    receipts say 32 (as an older worker's, the weight of the first part), their notes say what came: mallory and
    nora are credited nothing, pete half, each with the reason on /me; the honest three, the control, in full.
    Lost parts are not told as "not finite" or "zeros", and the aggregators that lost them are no disputers."""
    from app.credit import review
    from tests.test_credit_defences import disputes_by_author, reasons

    with sessions() as session:
        run = aged_run(session, "parts")
        names = ("alice", "bob", "carol", "mallory", "nora", "pete")
        peers = {name: Peer(session, run, name, tmp_path, i) for i, name in enumerate(names)}
        members = sorted(peer.peer_id for peer in peers.values())
        notes = {peers["mallory"].peer_id: ZEROS, peers["nora"].peer_id: NAN, peers["pete"].peer_id: HALF_LOST}
        records = []
        for name, peer in peers.items():
            mine = claim(1, 32, "g", {}, members)
            if name in ("alice", "bob", "carol"):  # the aggregators; the others are in client mode
                mine = claim(1, 32, "g", {"g": {p.peer_id: 32.0 for p in peers.values() if p is not peer}}, members)
                mine = mine.copy(update={"attested": {"g": notes}})
            records.append(peer.record(mine))
        credit_epochs(session, run, records)
        assert totals(session, run) == {"alice": (32, 0), "bob": (32, 0), "carol": (32, 0), "mallory": (0, 32),
                                        "nora": (0, 32), "pete": (16, 16)}
        [zeros] = reasons(session, run, "mallory")
        assert "every part it sent 3 aggregators was zeros, which adds nothing to a step" in zeros
        [nan] = reasons(session, run, "nora")
        assert "6 of 6 parts it sent 3 aggregators were not finite (NaN or infinity) and carry no credit" in nan
        [lost] = reasons(session, run, "pete")
        assert "3 of 6 parts did not reach 3 aggregators (lost in transit or the peer left the round early; " \
               "this is not an accusation)" in lost
        assert "not finite" not in lost and "zeros" not in lost
        assert disputes_by_author(session, run) == {} and review.disputers(session, run) == []

    app = create_app(Settings(database_url=database_url, data_dir=tmp_path))
    with TestClient(app) as client:
        page = sign_in(client, "mallory").get("/me").text
        assert "which adds nothing to a step" in held_table(page)
        assert "all 2 finite parts were zeros: they carry no credit" in page  # each aggregator's note
    with TestClient(app) as client:
        page = sign_in(client, "pete").get("/me").text
        held = held_table(page)
        assert "lost in transit" in held and "not an accusation" in held
        assert "not finite" not in held and "zeros" not in held
        assert "1 of 2 parts not received" in page
    with TestClient(app) as client:
        assert "Nothing held" in held_table(sign_in(client, "alice").get("/me").text)


def test_parts_lost_on_the_way_to_the_only_other_volunteer_are_unconfirmed_not_disputed(sessions, tmp_path):
    """pete averages with alice alone, and half his parts never reach her: he is credited the half that arrived and
    the rest is held as unconfirmed (lost in transit), with no dispute for an organizer. The control: quinn's weight,
    cut by alice's cap with every part received, is the disagreement an organizer decides."""
    from tests.test_credit_defences import disputes_by_author, reasons

    capped = Attestation(parts=2, weight=32.0, used=16.0, dropped=0, clipped=0, kept=1.0, expected=2)
    with sessions() as session:
        run = aged_run(session, "lost")
        for index, (group, sender, note) in enumerate((("g1", "pete", HALF_LOST), ("g2", "quinn", capped))):
            alice = Peer(session, run, f"alice-{group}", tmp_path, 2 * index)
            other = Peer(session, run, sender, tmp_path, 2 * index + 1)
            members = sorted((alice.peer_id, other.peer_id))
            seen = {group: {other.peer_id: 16.0}}
            mine = claim(1, 32, group, seen, members).copy(update={"attested": {group: {other.peer_id: note}}})
            credit_epochs(session, run, [alice.record(mine), other.record(claim(1, 32, group, {}, members))])
        assert totals(session, run)["pete"] == (16, 16) and totals(session, run)["quinn"] == (16, 16)
        [lost] = reasons(session, run, "pete")
        assert lost.startswith("not confirmed in full: 16 of its 32 samples reached the peers that averaged with it") \
            and "1 of 2 parts did not reach an aggregator" in lost and "not an accusation" in lost, lost
        [capped_reason] = reasons(session, run, "quinn")
        assert capped_reason.startswith("disputed: claimed 32 samples") and "capped" in capped_reason, capped_reason
        assert {author: claims for author, claims in disputes_by_author(session, run).items()} == {
            "alice-g2": [("quinn", "unresolved")]}


def aggregate(make_reducer, sent: dict[int, list], weights: dict[int, float],
              leaves_after: dict[int, int] | None = None):
    """A reducer (``make_reducer()``, made in the event loop as hivemind's runner makes it) fed every sender's parts
    (sender index -> parts, in order) with its weight, one part at a time per sender, as the runner does; a sender
    in ``leaves_after`` fails after that many parts."""
    async def send(reducer, sender: int):
        for index, part in enumerate(sent[sender]):
            if index == (leaves_after or {}).get(sender):
                reducer.on_sender_failed(sender)
                return
            await reducer.accumulate_part(sender, index, part, weight=weights[sender])

    async def run():
        reducer = make_reducer()
        await asyncio.wait_for(asyncio.gather(*(send(reducer, sender) for sender in sent)), timeout=10)
        return reducer

    return asyncio.run(run())


@pytest.mark.parametrize("aggregation", ["centered_clip", "mean"])
def test_real_reducers_receipts_credit_a_sender_of_zeros_or_nan_nothing_and_say_why(sessions, database_url, tmp_path,
                                                                                 aggregation):
    """The whole way: each honest aggregator's reducer (robust or the plain mean) is fed real parts, its tallies
    go through the worker's receipt log into its claim, and the coordinator credits the round. mallory sends
    zeros and nora NaN under the same plausible weight as the honest senders (32 samples); pete leaves the round
    after his first part. Credit: the honest senders in full, mallory and nora nothing, pete what arrived, with
    the reasons on /me."""
    from dedloc_worker.averaging.robust import (
        RobustPartReducer,
        RobustRule,
        TalliedPartReducer,
        applied_weights,
        notable_attestations,
    )
    from dedloc_worker.credit.receipts import ReceiptLog

    from tests.test_credit_defences import reasons

    names = ("alice", "bob", "carol", "mallory", "nora", "pete")
    torch.manual_seed(0)
    honest = {name: [torch.randn(8) for _ in range(2)] for name in ("alice", "bob", "carol", "pete")}
    sent = {**honest, "mallory": [torch.zeros(8)] * 2, "nora": [torch.full((8,), float("nan"))] * 2}
    with sessions() as session:
        run = aged_run(session, f"real-{aggregation.replace('_', '-')}", optimizer={"aggregation": aggregation})
        peers = {name: Peer(session, run, name, tmp_path, i) for i, name in enumerate(names)}
        ids = [peers[name].peer_id for name in names]
        records = []
        for name in names:
            found = claim(1, 32, "", {}, sorted(ids)).copy(update={"group": "ab" * 16})
            if name in ("alice", "bob", "carol"):  # an aggregator of a share of two parts
                shapes = [torch.Size([8])] * 2
                reducer = aggregate(
                    lambda: TalliedPartReducer(shapes, len(names)) if aggregation == "mean" else RobustPartReducer(
                        shapes, len(names), rule=RobustRule(tau=10.0, iterations=5), weight_cap=1000.0,
                        total_elements=48),
                    {i: sent[n] for i, n in enumerate(names)}, {i: 32.0 for i in range(6)},
                    leaves_after={names.index("pete"): 1})
                log = ReceiptLog(tmp_path / name)
                log.path.parent.mkdir(exist_ok=True)
                group = bytes.fromhex("ab" * 16)
                log.note_round(group, ids)
                log.note_attestation(group, notable_attestations(reducer, ids),
                                     applied_weights(reducer, ids, own=peers[name].peer_id))
                own, aggregated = log.drain()
                # as the trainer adds them to its claim, then read back from JSON as the coordinator reads records
                found = found.copy(update={"aggregated": aggregated, "attested": log.take_attested()})
                found = EpochContribution.parse_raw(found.json())
                assert own == "ab" * 16 and aggregated[own][peers["alice" if name != "alice" else "bob"].peer_id] == 32
            records.append(peers[name].record(found))
        credit_epochs(session, run, records)
        assert totals(session, run) == {"alice": (32, 0), "bob": (32, 0), "carol": (32, 0), "mallory": (0, 32),
                                        "nora": (0, 32), "pete": (16, 16)}
        assert "was zeros" in reasons(session, run, "mallory")[0]
        assert "were not finite (NaN or infinity)" in reasons(session, run, "nora")[0]
        assert "not an accusation" in reasons(session, run, "pete")[0]

    app = create_app(Settings(database_url=database_url, data_dir=tmp_path))
    for name, words in (("mallory", "which adds nothing to a step"), ("nora", "were not finite (NaN or infinity)"),
                        ("pete", "lost in transit or the peer left the round early")):
        with TestClient(app) as client:
            assert words in held_table(sign_in(client, name).get("/me").text), name


def test_a_tally_counts_every_part_and_a_few_zero_parts_are_honest():
    """``Attestation.applied``: the weight after the cap times the share of the expected parts that came finite;
    an honest gradient with some all-zero parts (parameters that got no gradient) keeps its whole weight."""
    from dedloc_worker.averaging.robust import Attestation as Tally

    honest = Tally(expected=3)
    for part in (torch.ones(4), torch.zeros(4), torch.ones(4)):
        assert honest.tally(part, 32.0)
    assert (honest.applied, honest.notable) == (32.0, False)
    capped = Tally(expected=2)
    for _ in range(2):
        capped.tally(torch.ones(4), 3200.0, cap=57.0)
    assert (capped.applied, capped.notable) == (57.0, True)
    negative = Tally(expected=1)
    assert not negative.tally(torch.ones(4), -5.0) and negative.applied == 0.0
    assert Attestation(**negative.as_record())  # a negative weight still makes a valid record


def test_a_sender_left_out_of_a_round_reads_so_not_as_nothing_cut():
    """An aggregator that left a sender out (its announced share was not its plan's) says why on the pages."""
    base = dict(run="r", group="g", epoch=1, sender="bob", aggregator="alice", parts=0, weight=64.0, used=0.0,
                dropped=0, clipped=0, kept=1.0)
    assert "left out" not in attestations.Cut(**base).words
    assert attestations.Cut(**base, left_out="announced share 1e9").words.startswith(
        "left out of the round: announced share 1e9")
