"""The adaptive averaging planner: known answers, properties over random swarms, hysteresis, the simulation bench."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.planner import (
    HOLD_BACK_FLOOR,
    PeerProfile,
    PlanningError,
    Replanner,
    byteps_seconds,
    equal_split_seconds,
    hivemind_shares,
    hivemind_split_seconds,
    lower_bound_seconds,
    parameter_server_seconds,
    plan_averaging,
    ring_allreduce_seconds,
    round_seconds,
)
from bench import simulate_averaging

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
V = 10e6  # bytes, the vector of the hivemind reference runs (docs/benchmarks.md#reference-figures)


def peer(name: str, up_mbit: float, down_mbit: float | None = None, **role: bool) -> PeerProfile:
    down_mbit = up_mbit if down_mbit is None else down_mbit
    return PeerProfile(name, 10.0, up_mbit * MBIT, down_mbit * MBIT, **role)


def reference_swarm() -> list[PeerProfile]:
    """docs/benchmarks.md#reference-figures: one peer at 400 Mbit/s and three at 50 Mbit/s."""
    return [peer("fast", 400)] + [peer(f"slow{i}", 50) for i in range(3)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- known answers ---------------------------------------------------------------------------------------------


def test_homogeneous_peers_share_equally_and_match_ring_allreduce():
    peers = [peer(f"p{i}", 100) for i in range(6)]
    plan = plan_averaging(peers, V)
    assert plan.shares == pytest.approx({p.peer: 1 / 6 for p in peers}, rel=1e-6)
    expected = 2 * 5 / 6 * V / (100 * MBIT)  # docs/benchmarks.md#lower-bounds: 2 (n - 1) / n * V / B
    assert plan.predicted_seconds == pytest.approx(expected, rel=1e-6)
    assert plan.lower_bound_seconds == pytest.approx(expected, rel=1e-9)
    assert ring_allreduce_seconds(peers, V) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("fast_is_aux", [False, True])
def test_far_faster_peer_takes_the_whole_vector(fast_is_aux):
    peers = [peer("fast", 10_000, aux=fast_is_aux)] + [peer(f"slow{i}", 100) for i in range(4)]
    floor = HOLD_BACK_FLOOR / (4 if fast_is_aux else 5)  # the floor is spread over the senders
    plan = plan_averaging(peers, V)
    # the slow peers keep only the floor share that spares them hivemind's hold-back
    assert plan.shares["fast"] == pytest.approx(1 - 4 * floor, rel=1e-9)
    assert [plan.shares[f"slow{i}"] for i in range(4)] == pytest.approx([floor] * 4, rel=1e-9)
    assert plan.predicted_seconds == pytest.approx(plan.lower_bound_seconds, rel=HOLD_BACK_FLOOR)
    without_hold_back = plan_averaging(peers, V, hold_back=False)
    assert without_hold_back.shares["fast"] == pytest.approx(1.0, abs=1e-9)


def test_client_mode_peers_get_zero_even_when_fastest():
    peers = [peer("nat-fast", 1000, client_mode=True), peer("nat-slow", 10, client_mode=True)]
    peers += [peer("pub-a", 100), peer("pub-b", 50)]
    plan = plan_averaging(peers, V)
    assert plan.shares["nat-fast"] == 0.0 and plan.shares["nat-slow"] == 0.0
    assert plan.shares["pub-a"] + plan.shares["pub-b"] == pytest.approx(1.0)
    # a client pushes, then pulls (hold-back): the slow one alone takes V/u + V/d
    assert plan.predicted_seconds >= 2 * V / (10 * MBIT) - 1e-9
    assert lower_bound_seconds(peers, V) == pytest.approx(2 * V / (10 * MBIT))
    assert lower_bound_seconds(peers, V, hold_back=False) == pytest.approx(V / (10 * MBIT))


def test_the_bound_puts_what_client_mode_peers_cannot_carry_on_the_aggregators():
    """4 x 100 Mbit/s, one behind NAT: it moves V each way, the three others carry the rest of the 6 V, 5/3 V each.

    Summing every peer's link (1.5 V each) gave a bound no split reaches; the planner's optimum is the bound."""
    peers = [peer(f"pub-{i}", 100) for i in range(3)] + [peer("nat", 100, client_mode=True)]
    assert lower_bound_seconds(peers, V, hold_back=False) == pytest.approx(5 / 3 * V / (100 * MBIT))
    plan = plan_averaging(peers, V, hold_back=False)
    assert plan.shares == pytest.approx({"pub-0": 1 / 3, "pub-1": 1 / 3, "pub-2": 1 / 3, "nat": 0.0})
    assert plan.predicted_seconds == pytest.approx(plan.lower_bound_seconds, rel=1e-9)


def test_every_peer_in_client_mode_is_refused():
    with pytest.raises(PlanningError, match="client mode"):
        plan_averaging([peer("a", 100, client_mode=True), peer("b", 100, client_mode=True)], V)


def test_bad_input_is_refused_with_a_reason():
    with pytest.raises(PlanningError, match="unique"):
        plan_averaging([peer("a", 100), peer("a", 50)], V)
    with pytest.raises(PlanningError, match="upload_bps"):
        PeerProfile("a", 1.0, 0.0, 1e6)
    with pytest.raises(PlanningError, match="vector_bytes"):
        plan_averaging([peer("a", 100)], 0)
    with pytest.raises(PlanningError, match="client-mode"):
        round_seconds([peer("a", 100), peer("b", 100, client_mode=True)], {"a": 0.5, "b": 0.5}, V)


def test_reference_links_reproduce_bench_notes_model():
    """400 + 3 x 50 Mbit/s: hivemind's own split loses to an equal split; the planner reaches the bound."""
    peers = reference_swarm()
    assert hivemind_shares(peers) == {"fast": 1.0, "slow0": 0.0, "slow1": 0.0, "slow2": 0.0}
    assert lower_bound_seconds(peers, V) == pytest.approx(1.6)
    assert equal_split_seconds(peers, V) == pytest.approx(2.4)
    assert hivemind_split_seconds(peers, V) == pytest.approx(3.2)  # slow peers push, then pull: 1.6 s + 1.6 s
    assert hivemind_split_seconds(peers, V) > equal_split_seconds(peers, V)
    assert plan_averaging(peers, V).predicted_seconds == pytest.approx(1.6, rel=HOLD_BACK_FLOOR)


def test_round_time_model_known_answers():
    senders = [peer(f"p{i}", 100) for i in range(4)]
    equal = {p.peer: 0.25 for p in senders}
    # each sender moves (1 + (n - 2) s) V bytes each way, both directions at once
    assert round_seconds(senders, equal, V) == pytest.approx(1.5 * V / (100 * MBIT))
    # an aux server with the whole vector moves n_s V each way; zero-share senders push, then pull
    swarm = [peer("cpu", 100, aux=True)] + [peer(f"w{i}", 1000) for i in range(3)]
    assert round_seconds(swarm, {"cpu": 1.0}, V, hold_back=False) == pytest.approx(3 * V / (100 * MBIT))
    fast_swarm = [peer("cpu", 10_000, aux=True)] + [peer(f"w{i}", 1000, 500) for i in range(3)]
    expected = V / (1000 * MBIT) + V / (500 * MBIT)
    assert round_seconds(fast_swarm, {"cpu": 1.0}, V) == pytest.approx(expected)


def test_hivemind_split_uses_the_binding_direction():
    peers = [peer("asym", 400, 50)] + [peer(f"p{i}", 100) for i in range(3)]
    shares = hivemind_shares(peers)
    assert shares["asym"] == 0.0
    assert [shares[f"p{i}"] for i in range(3)] == pytest.approx([1 / 3] * 3)


def test_baselines_known_answers():
    homogeneous = [peer(f"p{i}", 1000) for i in range(16)]
    assert parameter_server_seconds(homogeneous, 1e8) == pytest.approx(15 * 1e8 / (1000 * MBIT))
    servers = [peer(f"cpu{i}", 1000, aux=True) for i in range(4)]
    workers = [peer(f"w{i}", 50, 200) for i in range(16)]
    upload, download = 1e8 / (50 * MBIT), 1e8 / (200 * MBIT)
    assert byteps_seconds(servers + workers, 1e8) == pytest.approx(upload + download)
    assert byteps_seconds(servers + workers, 1e8, hold_back=False) == pytest.approx(upload)
    nat_majority = [peer("pub", 100)] + [peer(f"nat{i}", 100, client_mode=True) for i in range(2)]
    assert ring_allreduce_seconds(nat_majority, V) == math.inf


def test_only_auxiliary_peers_have_nothing_to_average():
    plan = plan_averaging([peer("cpu0", 100, aux=True), peer("cpu1", 100, aux=True)], V)
    assert plan.predicted_seconds == 0.0 and sum(plan.shares.values()) == pytest.approx(1.0)


# --- properties over random swarms -----------------------------------------------------------------------------

bandwidths = st.floats(min_value=1e6, max_value=5e8)  # bytes/s; up/down within 500x keeps the floor argument valid
profiles = st.lists(
    st.tuples(bandwidths, bandwidths, st.booleans(), st.booleans()), min_size=2, max_size=12
).map(
    lambda rows: [
        PeerProfile(f"p{i}", 1.0, up, down, client_mode=client and i > 0, aux=aux and i > 1)
        for i, (up, down, client, aux) in enumerate(rows)
    ]
)


@settings(max_examples=50, deadline=None, database=None)
@given(peers=profiles)
def test_plan_is_valid_and_between_the_bound_and_every_share_strategy(peers):
    plan = plan_averaging(peers, 1e8)
    shares = np.array([plan.shares[p.peer] for p in peers])
    assert set(plan.shares) == {p.peer for p in peers}
    assert (shares >= 0).all() and shares.sum() == pytest.approx(1.0, abs=1e-9)
    assert all(plan.shares[p.peer] == 0.0 for p in peers if p.client_mode)
    assert plan.predicted_seconds == pytest.approx(round_seconds(peers, plan.shares, 1e8), rel=1e-12)
    assert plan.predicted_seconds >= plan.lower_bound_seconds * (1 - 1e-9)
    # equal shares are a feasible point of the LP; the others only differ from one by the floor share
    assert plan.predicted_seconds <= equal_split_seconds(peers, 1e8) * (1 + 1e-7)
    slack = 1 + HOLD_BACK_FLOOR + 1e-7
    for strategy in (parameter_server_seconds, byteps_seconds, hivemind_split_seconds):
        assert plan.predicted_seconds <= strategy(peers, 1e8) * slack, strategy.__name__


def test_thousand_peers_get_a_valid_plan():
    rng = np.random.default_rng(7)
    peers = [
        PeerProfile(f"p{i}", 1.0, up, down, client_mode=i % 5 == 1, aux=i % 20 == 2)
        for i, (up, down) in enumerate(rng.uniform(1e6, 1.25e8, size=(1000, 2)).tolist())
    ]
    plan = plan_averaging(peers, 1e8)
    shares = np.array(list(plan.shares.values()))
    assert len(shares) == 1000 and (shares >= 0).all() and shares.sum() == pytest.approx(1.0)
    assert all(plan.shares[p.peer] == 0.0 for p in peers if p.client_mode)
    assert plan.lower_bound_seconds <= plan.predicted_seconds <= equal_split_seconds(peers, 1e8)


def test_planner_imports_neither_torch_nor_hivemind():
    code = "import sys, app.planner; sys.exit(bool({'torch', 'hivemind'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# --- hysteresis --------------------------------------------------------------------------------------------------


def test_replanner_publishes_first_plan_then_keeps_it_for_the_same_peers():
    clock = FakeClock()
    replanner = Replanner(vector_bytes=V, clock=clock)
    first = replanner.update(reference_swarm())
    assert first is not None and replanner.current is first
    clock.now += 3600
    assert replanner.update(reference_swarm()) is None
    assert replanner.current is first and replanner.last_reason == "peers unchanged"


def test_replanner_waits_for_the_interval_before_planning_for_a_new_peer():
    clock = FakeClock()
    replanner = Replanner(vector_bytes=V, clock=clock, min_interval_s=30)
    replanner.update(reference_swarm())
    grown = reference_swarm() + [peer("newcomer", 50)]
    clock.now += 10
    assert replanner.update(grown) is None and "too recent" in replanner.last_reason
    clock.now += 25
    # the old plan gives the newcomer share zero, so it would push, then pull: the new plan is far faster
    plan = replanner.update(grown)
    assert plan is not None and plan.shares["newcomer"] > 0


def test_replanner_names_a_newcomer_after_the_interval_even_when_the_plan_would_not_be_faster():
    clock = FakeClock()
    # a slow newcomer paces the round whatever the split, and without hold-back a zero share costs it nothing
    # extra: the old plan is as fast as a new one, but it does not name the newcomer
    replanner = Replanner(vector_bytes=V, clock=clock, min_interval_s=30, hold_back=False)
    equal = [peer(f"p{i}", 100) for i in range(3)]
    replanner.update(equal)
    grown = equal + [peer("newcomer", 10)]
    clock.now += 31
    plan = replanner.update(grown)
    assert plan is not None and "newcomer" in plan.shares, replanner.last_reason
    clock.now += 31
    assert replanner.update(grown) is None  # and then it is kept: same peers


def test_replanner_replaces_a_plan_naming_a_departed_peer_at_once():
    clock = FakeClock()
    replanner = Replanner(vector_bytes=V, clock=clock, min_interval_s=3600)
    replanner.update(reference_swarm())
    shrunk = [p for p in reference_swarm() if p.peer != "slow2"]
    plan = replanner.update(shrunk)
    assert plan is not None and set(plan.shares) == {"fast", "slow0", "slow1"}


@pytest.mark.parametrize(("threshold", "published"), [(0.05, False), (0.01, True)])
def test_replanner_publishes_only_improvements_above_the_threshold(threshold, published):
    equal = [peer(f"p{i}", 100) for i in range(4)]
    upgraded = [peer("p0", 112)] + equal[1:]  # p0's link measured 12% faster: it should take a bit more
    old_plan = plan_averaging(equal, V)
    gain = 1 - plan_averaging(upgraded, V).predicted_seconds / round_seconds(upgraded, old_plan.shares, V)
    assert 0.01 < gain < 0.05  # the case sits between the two thresholds
    clock = FakeClock()
    replanner = Replanner(vector_bytes=V, clock=clock, min_improvement=threshold)
    first = replanner.update(equal)
    clock.now += 60
    assert (replanner.update(upgraded) is not None) is published
    assert (replanner.current is first) is not published


# --- the simulation bench --------------------------------------------------------------------------------------


def test_bench_writes_one_profile_as_json(tmp_path, capsys):
    out = tmp_path / "results" / "sim.json"
    assert simulate_averaging.main(["--profile", "mixed-8x1G-8x100M", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 1
    row = rows[0]
    assert {"profile", "mode", "ring", "equal", "hivemind", "planner", "lower_bound"} <= set(row)
    assert row["profile"] == "mixed-8x1G-8x100M" and row["mode"] == "sim"
    assert row["planner"] <= row["lower_bound"] * 1.02
    assert row["ring_over_planner"] == pytest.approx(row["ring"] / row["planner"], rel=1e-5)
    assert row["ring_over_planner"] > 1.8
    assert "mixed-8x1G-8x100M" in capsys.readouterr().out


@pytest.mark.parametrize("vector_bytes", [100e6, 548_352])  # a 100 MB model; the swarm tests' 0.5 MB one
def test_a_live_plan_gives_every_sender_parts_of_the_others_and_little_more(vector_bytes):
    """The coordinator's floor: enough of the vector that each sender aggregates whole parts (so it sees, and can
    attest, the others' weights), and on a large model so little that the plan stays near the bound."""
    from dedloc_common.contract import GRADIENT_PART_BYTES as PART_BYTES

    from app.coordinator.planning import ATTESTATION_PARTS, attestation_floor

    peers = [peer("fast", 100)] + [peer(f"slow{i}", 12.5) for i in range(3)]
    plan = plan_averaging(peers, vector_bytes, min_share=attestation_floor(peers, vector_bytes))
    least = min(plan.shares.values())
    assert least * vector_bytes >= min(ATTESTATION_PARTS * PART_BYTES, vector_bytes / 8) * (1 - 1e-9)
    if vector_bytes >= 50 * ATTESTATION_PARTS * PART_BYTES:
        assert plan.predicted_seconds <= 1.03 * plan.lower_bound_seconds, plan
        assert least < 0.02
