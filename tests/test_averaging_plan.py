"""Averaging with a planned split: real hivemind averagers apply a plan and still compute the exact weighted mean,
and leave out a member whose announced share its signed plan does not give it.

Also pins the hivemind 1.1.12 internals ``dedloc_worker.averaging.planned`` relies on, so that an upgrade fails here.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hashlib
import inspect
import time
from types import SimpleNamespace

import hivemind
import pytest
import torch
from dedloc_common.cleanup import _is_torch_shm_manager, descendants
from dedloc_common.contract import Attestation, PlanRecord, plan_payload
from dedloc_common.signing import new_private_key, sign
from dedloc_worker.averaging.announcements import (
    PLAN_MARKER,
    Announcement,
    PlanCheck,
    split_group,
    trusted_shares,
    unwrap,
)
from dedloc_worker.averaging.planned import (
    IN_FLIGHT_PARTS,
    PlannedAverager,
    PlannedGradientAverager,
    RoundOutcome,
    planned_fractions,
)
from dedloc_worker.credit.receipts import ReceiptLog
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.optim.grad_averager import GradientAverager

from app.planner import PeerProfile, plan_averaging

pytestmark = [
    # hivemind run in-process leaves its background event loops unclosed when garbage-collected.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]
NODE, CLIENT = AveragingMode.NODE, AveragingMode.CLIENT
ELEMENTS = 100_000  # with 1,000-element parts, every share below falls on a part boundary
PART_BYTES = 4_000  # 1,000 fp32 values per part
WAITS = {"min_matchmaking_time": 0.5, "request_timeout": 0.25}  # an averager's matchmaking_kwargs, in part


# --- the split rule, alone -------------------------------------------------------------------------------------


def test_shares_of_every_member_are_used_as_given():
    fractions = planned_fractions(ELEMENTS, [None] * 3, [NODE] * 3, [0.6, 0.3, 0.1])
    assert fractions == pytest.approx((0.6, 0.3, 0.1))


def test_shares_are_normalised_when_a_planned_peer_is_absent():
    assert planned_fractions(ELEMENTS, [None] * 2, [NODE] * 2, [0.5, 0.25]) == pytest.approx((2 / 3, 1 / 3))


def test_a_peer_the_plan_does_not_name_keeps_hiveminds_fraction():
    # hivemind splits equally when nobody announces a bandwidth; the planned peers share the rest 2:1
    fractions = planned_fractions(90_000, [None] * 3, [NODE] * 3, [0.6, 0.3, None])
    assert fractions == pytest.approx((4 / 9, 2 / 9, 1 / 3))


def test_client_mode_peers_get_zero_whatever_they_announce():
    fractions = planned_fractions(ELEMENTS, [None] * 3, [NODE, NODE, CLIENT], [0.5, 0.25, 0.25])
    assert fractions == pytest.approx((2 / 3, 1 / 3, 0.0))


def test_without_any_share_hiveminds_own_split_is_kept():
    bandwidths = [100.0, 50.0, 50.0]
    fractions = planned_fractions(ELEMENTS, bandwidths, [NODE] * 3, [None] * 3)
    expected = hivemind.averaging.load_balancing.load_balance_peers(ELEMENTS, bandwidths)
    assert fractions == pytest.approx(tuple(count / ELEMENTS for count in expected))


def test_without_the_authority_a_member_without_the_marker_makes_everyone_use_hiveminds_split():
    announcements, user = unwrap([[PLAN_MARKER, 0.7, None, "a"], "plain-hivemind", [PLAN_MARKER, 0.3, None, None]])
    assert trusted_shares(announcements) == [None, None, None]
    assert user == ["a", "plain-hivemind", None]


def test_set_plan_refuses_negative_or_non_finite_shares():
    averager = PlannedAverager.__new__(PlannedAverager)  # no process: set_plan is plain Python
    with pytest.raises(ValueError, match="finite fraction"):
        averager.set_plan({"peer": -0.1})
    with pytest.raises(ValueError, match="finite fraction"):
        averager.set_plan({"peer": float("nan")})


# --- shares checked against the signed plan (docs/averaging.md#checked-shares) ---------------------------------


@functools.lru_cache(maxsize=None)
def authority():
    """The run's authority key of this module's plans."""
    return new_private_key()


def signed_plan(shares: dict, issued_at: float = 1000.0, key=None) -> PlanRecord:
    """A plan as the coordinator publishes it, signed by ``key`` (the run's authority by default)."""
    signature = sign(key or authority(), plan_payload(shares, 0.5, issued_at, {}))
    return PlanRecord(shares=shares, predicted_seconds=0.5, issued_at=issued_at, signature=signature)


def said(share, plan: PlanRecord | None) -> Announcement:
    """One member's announcement as the others receive it."""
    return Announcement(share, None if plan is None else plan.dict())


def split(announcements, modes=(NODE,) * 3, peers=("A", "B", "C")):
    return split_group(list(peers), list(modes), announcements, PlanCheck(authority().public_key()))


THIRDS = {"A": 1 / 3, "B": 1 / 3, "C": 1 / 3}


def test_a_member_announcing_a_share_of_1e9_is_left_out_instead_of_taking_the_vector():
    # the hole: taken as announced, the third peer aggregates all but 7e-10 of the vector
    assert planned_fractions(10**6, [None] * 3, [NODE] * 3, [1 / 3, 1 / 3, 1e9])[2] > 0.999_999_999
    plan = signed_plan(THIRDS)
    checked = split([said(1 / 3, plan), said(1 / 3, plan), said(1e9, plan)])
    assert checked.fractions == pytest.approx((0.5, 0.5, 0.0))
    assert list(checked.left_out) == ["C"] and "share 1000000000.0 where its plan" in checked.left_out["C"]
    assert checked.plan == plan


def test_a_member_announcing_zero_while_planned_to_aggregate_is_left_out():
    plan = signed_plan(THIRDS)
    checked = split([said(1 / 3, plan), said(0.0, plan), said(1 / 3, plan)])
    assert checked.fractions == pytest.approx((0.5, 0.0, 0.5))
    assert list(checked.left_out) == ["B"] and "share 0.0 where its plan" in checked.left_out["B"]
    # control: a zero its plan gives it (a client-mode peer) stands, and so does the plan's share to 1e-9
    plan = signed_plan({"A": 0.5, "B": 0.5, "C": 0.0})
    checked = split([said(0.5 + 1e-10, plan), said(0.5, plan), said(0.0, plan)], modes=(NODE, NODE, CLIENT))
    assert checked.left_out == {} and checked.fractions == pytest.approx((0.5, 0.5, 0.0))


def test_without_a_plan_shares_are_equal_and_a_share_announced_without_one_is_left_out():
    checked = split([said(None, None)] * 3)
    assert checked.fractions == pytest.approx((1 / 3,) * 3) and checked.plan is None and checked.left_out == {}
    checked = split([said(None, None), said(None, None), said(0.9, None)])
    assert checked.fractions == pytest.approx((0.5, 0.5, 0.0)) and "without a plan" in checked.left_out["C"]
    # a member the plan does not name gets an equal fraction; the named share the rest 2:1
    checked = split([said(0.6, plan := signed_plan({"A": 0.6, "B": 0.3})), said(0.3, plan), said(None, plan)])
    assert checked.fractions == pytest.approx((4 / 9, 2 / 9, 1 / 3)) and checked.left_out == {}


def test_members_on_plans_of_different_versions_agree_on_the_newest_and_each_is_checked_against_its_own():
    old = signed_plan({"A": 0.5, "B": 0.25, "C": 0.25}, issued_at=1000.0)
    new = signed_plan({"A": 0.2, "B": 0.4, "C": 0.4}, issued_at=2000.0)
    # B and C have not read the new plan yet: they announce the old one's shares, and follow the new one
    checked = split([said(0.2, new), said(0.25, old), said(0.25, old)])
    assert checked.left_out == {} and checked.plan == new and checked.fractions == pytest.approx((0.2, 0.4, 0.4))
    # ... whichever member announced it (every member computes this from the same announcements)
    assert split([said(0.5, old), said(0.25, old), said(0.4, new)]).fractions == pytest.approx((0.2, 0.4, 0.4))
    # a share from one plan announced with another is left out
    checked = split([said(0.2, new), said(0.4, old), said(0.25, old)])
    assert list(checked.left_out) == ["B"] and "plan of 1000.0 gives it 0.25" in checked.left_out["B"]
    assert checked.fractions == pytest.approx((0.2 / 0.6, 0.0, 0.4 / 0.6))


def test_a_plan_the_authority_did_not_sign_or_a_foreign_member_is_left_out():
    plan = signed_plan(THIRDS)
    forged = signed_plan({"A": 0.1, "B": 0.1, "C": 0.8}, issued_at=3000.0, key=new_private_key())
    edited = PlanRecord(**{**plan.dict(), "shares": {"A": 0.1, "B": 0.1, "C": 0.8}})  # signature of another plan
    for lie in (said(0.8, forged), said(0.8, edited)):
        checked = split([said(1 / 3, plan), said(1 / 3, plan), lie])
        assert checked.plan == plan and checked.fractions == pytest.approx((0.5, 0.5, 0.0))
        assert checked.left_out == {"C": "announced a plan the run's authority did not sign"}
    checked = split([said(1 / 3, plan), Announcement(1 / 3, {"shares": "all"}), None])
    assert checked.left_out == {"B": "announced a malformed plan",
                                "C": f"announced no {PLAN_MARKER} marker: not a planned averager of this version"}
    assert checked.fractions == pytest.approx((1.0, 0.0, 0.0))


def test_a_metrics_record_with_a_left_out_attestation_passes_the_dhts_schema_as_sent():
    """hivemind's SchemaValidator refuses a record that parsing changes: a left-out note (every field) and a note of
    robust aggregation (no ``left_out``) must both come out of the contract's parsing as they went in."""
    from dedloc_common.contract import EpochContribution, MetricsRecord, metrics_key
    from dedloc_worker.averaging.robust import Attestation as Tally
    from dedloc_worker.swarm.records import MetricsSchema
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.dht.schema import SchemaValidator
    from hivemind.dht.validation import DHTRecord

    left_out = Attestation(parts=0, weight=0.0, used=0.0, dropped=0, clipped=0, kept=1.0, left_out="why").dict()
    clipped = Tally(parts=2, weight=3.0, used=3.0).as_record()
    claim = EpochContribution(epoch=3, samples=32, loss_sum=1.0, mini_steps=1, seconds=1.0).copy(
        update={"attested": {"ab12": {"QmLiar": left_out, "QmClipped": clipped}}})
    validator, signer = SchemaValidator(MetricsSchema, prefix="run"), RSASignatureValidator()

    def accepted(record: dict) -> bool:
        return validator.validate(DHTRecord(
            key=DHTID.generate(source=metrics_key("run")).to_bytes(),
            subkey=DHTProtocol.serializer.dumps(signer.local_public_key),
            value=DHTProtocol.serializer.dumps(record), expiration_time=time.time() + 60))

    record = MetricsRecord(username="alice", epoch=3, samples_per_second=1.0, time=1.0, recent=[]).dict()
    assert accepted({**record, "recent": [claim.dict()]})
    # control: a note that parsing changes (an empty left_out said aloud) is refused
    said = {**left_out, "left_out": None}
    assert not accepted({**record, "recent": [claim.copy(update={"attested": {"ab12": {"QmLiar": said}}}).dict()]})


def test_an_averager_with_the_authority_takes_only_signed_plans():
    averager = PlannedAverager.__new__(PlannedAverager)  # no process: set_plan is plain Python
    averager._plan_check = PlanCheck(authority().public_key())
    with pytest.raises(ValueError, match="signed plan"):
        averager.set_plan(THIRDS)
    with pytest.raises(ValueError, match="not signed by the run's authority"):
        averager.set_plan(signed_plan(THIRDS, key=new_private_key()))
    averager.set_plan(signed_plan(THIRDS))  # control
    assert averager.plan == THIRDS


def test_a_client_mode_peer_leaves_the_planners_split_balanced():
    """The split a plan hands the averagers (app.planner): a client's fixed time is no reason for a lopsided one.

    The client's push-then-pull time used to be a floor under the LP's round time, so that every split keeping the
    others below it was optimal and highs returned 0.5 / 0.5 / 0.00025, 1.3x slower than equal on emulated links.
    """
    mbit = 1e6 / 8
    peers = [PeerProfile(f"p{i}", 1.0, 100 * mbit, 100 * mbit) for i in range(3)]
    plan = plan_averaging(peers + [PeerProfile("nat", 1.0, 100 * mbit, 100 * mbit, client_mode=True)], 1e7)
    assert plan.shares == pytest.approx({"p0": 1 / 3, "p1": 1 / 3, "p2": 1 / 3, "nat": 0.0}, rel=1e-6)
    assert plan.predicted_seconds == pytest.approx(2 * 0.8)  # the client pushes 10 MB, then pulls it


# --- the hivemind internals relied on (fail on upgrade) --------------------------------------------------------

# sha256 of inspect.getsource(DecentralizedAverager._aggregate_with_group) in hivemind 1.1.12: the method
# PlannedAverager replaces. If this changes, re-read hivemind's version and port the change to averaging.py.
AGGREGATE_WITH_GROUP_SHA256 = "c297d8a435ce2b1c0ca36b8e6bc318a23b1c696ef1624dabc654cee803650868"
# ... and of _run_allreduce_inplace_, which PlannedAverager copies with the runner's class as a parameter
RUN_ALLREDUCE_INPLACE_SHA256 = "914d57cffc7d69e1ce16b384f3fc0783fbbf08b7fa839634da9571f9c4143925"


def test_hivemind_internals_are_those_the_planned_averager_was_written_against():
    assert hivemind.__version__ == "1.1.12"
    replaced = inspect.getsource(DecentralizedAverager._aggregate_with_group)
    assert hashlib.sha256(replaced.encode()).hexdigest() == AGGREGATE_WITH_GROUP_SHA256
    copied = inspect.getsource(DecentralizedAverager._run_allreduce_inplace_)
    assert hashlib.sha256(copied.encode()).hexdigest() == RUN_ALLREDUCE_INPLACE_SHA256
    # what each peer announces, and how step hands it to matchmaking
    assert "[self.bandwidth, self.mode.value, user_data_for_gather]" in inspect.getsource(DecentralizedAverager.step)
    assert "self._running_groups[group_id].set_result(runner)" in inspect.getsource(
        DecentralizedAverager._run_allreduce_inplace_)
    # hold-back of zero-fraction peers, and the runner attributes read after a round
    assert "self.peer_fractions[self.ordered_peer_ids.index(peer_id)] == 0" in inspect.getsource(
        AllReduceRunner.should_delay_results)
    # both ends of a stream ask it (so StreamingAllReduceRunner only runs where every member uses it)
    assert "self.should_delay_results(self.peer_id)" in inspect.getsource(AllReduceRunner._communicate_with_peer)
    assert "self.should_delay_results(context.remote_id)" in inspect.getsource(AllReduceRunner.rpc_aggregate_part)
    # the window: what a sender streams to an aggregator, and where the aggregator's results are taken in
    communicate = inspect.getsource(AllReduceRunner._communicate_with_peer)
    assert "self._generate_input_for_peer(peer_index)" in communicate
    # where CountingAllReduceRunner counts the results coming back (the parts going out: _generate_input_for_peer)
    assert "self._get_peer_stub(peer_id).rpc_aggregate_part(inputs_aiter)" in communicate
    assert "self.tensor_part_container.register_processed_part(peer_index, part_index, delta)" in communicate
    runner_init = inspect.getsource(AllReduceRunner.__init__)
    for attribute in ("self.parts_for_local_averaging", "self.tensor_part_container", "self.tensor_part_reducer"):
        assert attribute in runner_init
    assert "self._outer_pipe.send((\"_get_group_bits\"" in inspect.getsource(DecentralizedAverager.get_group_bits)
    # GradientAverager.schedule_step goes through super().step, which must resolve to PlannedAverager.step
    assert "super().step(" in inspect.getsource(GradientAverager.schedule_step)
    assert super(GradientAverager, PlannedGradientAverager).step is PlannedAverager.step
    # PlannedAverager.rpc_aggregate_part is hivemind's with the runner's future shielded
    assert "group = await future\n" in inspect.getsource(DecentralizedAverager.rpc_aggregate_part)
    # leaving a member out (PlannedAverager._refuse_left_out) bans it as hivemind bans a late sender: its parts are
    # refused, a sender counted as started is not waited for, and the reducer's count says nothing is missing
    from hivemind.averaging.partition import TensorPartReducer

    assert "self.tensor_part_reducer.on_sender_failed(self.sender_peer_ids.index(peer_id))" in inspect.getsource(
        AllReduceRunner._ban_sender)
    assert "if peer_id not in self.active_senders and peer_id not in self.banned_senders:" in inspect.getsource(
        AllReduceRunner._handle_missing_senders)
    assert "self.all_senders_started.wait()" in inspect.getsource(AllReduceRunner._handle_missing_senders)
    assert 'if self.sender_failed_after[sender_index] != float("inf"):' in inspect.getsource(
        TensorPartReducer.accumulate_part)
    assert "parts_received = sum(self.num_parts_received)" in inspect.getsource(TensorPartReducer.finalize)


def stand_in(**attributes) -> SimpleNamespace:
    """What an averager's ``rpc_aggregate_part`` reads of it, hivemind's and ours (the sender timeout unset: the
    wait for a group is then a matchmaking time and a request timeout)."""
    averager = SimpleNamespace(_pending_groups_registered=asyncio.Event(), matchmaking_kwargs=WAITS,
                               next_chunk_timeout=None, **attributes)
    averager._wait_for_group = functools.partial(PlannedAverager._wait_for_group, averager)
    return averager


def test_a_sender_dropping_its_stream_before_the_round_starts_leaves_the_round_startable():
    """A sender's handler waits for this peer's round to start; when the sender drops its stream (it gave up, its
    link went down), the handler is cancelled. hivemind's handler awaits the round's shared future bare, so the
    cancel reached the future and this peer's round then failed to start (``InvalidStateError``); ours shields it."""
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import anext, as_aiter

    async def drop_a_sender(handler) -> asyncio.Future:
        averager = stand_in(_running_groups={b"g": asyncio.Future()})
        waiting = asyncio.create_task(anext(handler(averager, as_aiter(averaging_pb2.AveragingData(group_id=b"g")),
                                                    None)))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the handler got as far as waiting for the round's runner
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        return averager._running_groups[b"g"]

    runner = asyncio.run(drop_a_sender(PlannedAverager.rpc_aggregate_part))
    assert not runner.done()
    runner.set_result("the runner")  # what _run_allreduce_inplace_ does as the round starts
    assert asyncio.run(drop_a_sender(DecentralizedAverager.rpc_aggregate_part)).cancelled()  # hivemind's own
    # and peers call it as they call hivemind's: the handler hivemind registers from its annotations is the same
    handlers = {}
    for servicer in (DecentralizedAverager, PlannedAverager):
        fresh = type("Fresh", (servicer,), {"_rpc_handlers": None})  # collected anew, not inherited from a parent
        fresh._collect_rpc_handlers()
        handlers[servicer] = [h for h in fresh._rpc_handlers if h.method_name == "rpc_aggregate_part"]
    assert handlers[PlannedAverager] == handlers[DecentralizedAverager] and len(handlers[PlannedAverager]) == 1


def test_a_part_for_a_group_that_never_forms_is_answered_within_a_matchmaking_time():
    """hivemind's handler waits for the next group this peer registers, however long that takes (the control of
    tests/test_attacks.py timed out while the victim was alone); ours answers BAD_GROUP_ID after a matchmaking time
    (or a sender timeout, where that is longer: test_a_part_waits_up_to_the_sender_timeout_...)."""
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import anext, as_aiter

    async def ask(handler):
        averager = stand_in(_running_groups={})  # looking for a group: no group registered yet
        reply = handler(averager, as_aiter(averaging_pb2.AveragingData(group_id=b"never")), None)
        try:
            return await asyncio.wait_for(anext(reply), 3.0)
        except asyncio.TimeoutError:
            return None

    began = time.monotonic()
    assert asyncio.run(ask(PlannedAverager.rpc_aggregate_part)).code == averaging_pb2.BAD_GROUP_ID
    assert time.monotonic() - began < 3.0
    assert asyncio.run(ask(DecentralizedAverager.rpc_aggregate_part)) is None  # hivemind's: still waiting


def test_a_part_whose_senders_all_weigh_nothing_averages_to_zeros_not_nan():
    import asyncio

    from dedloc_worker.averaging.planned import guard_weightless_parts
    from hivemind.averaging.partition import TensorPartReducer

    assert "self.accumulator.div_(self.denominator)" in inspect.getsource(
        getattr(TensorPartReducer.check_current_part_finished, "__wrapped__",
                TensorPartReducer.check_current_part_finished))

    async def reduce(weights):
        reducer = TensorPartReducer([torch.Size([4])], num_senders=len(weights))
        parts = [torch.full((4,), float(i + 1)) for i in range(len(weights))]
        return await asyncio.gather(*(reducer.accumulate_part(i, 0, part, weight=w)
                                      for i, (part, w) in enumerate(zip(parts, weights))))

    guard_weightless_parts()
    assert torch.equal(asyncio.run(reduce([0.0, 0.0]))[0], torch.zeros(4))  # hivemind alone: NaN
    assert torch.allclose(asyncio.run(reduce([1.0, 3.0]))[0], torch.full((4,), 1.75))  # weighted mean unchanged


# --- three real averagers --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_averagers(tmp_path_factory):
    """Three DHT peers on loopback, each with a PlannedAverager over one 100,000-element fp32 tensor that checks
    plans against this module's authority and attests into a ``ReceiptLog`` (the averager's ``receipts``)."""
    before = set(descendants())
    dhts, averagers = [], []
    try:
        for _ in range(3):
            initial = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(hivemind.DHT(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True))
        for dht in dhts:
            receipts = ReceiptLog(tmp_path_factory.mktemp("receipts"))
            averagers.append(PlannedAverager(
                [torch.zeros(ELEMENTS)], dht, prefix="plan_test", start=True, target_group_size=3,
                min_group_size=3, min_matchmaking_time=1.0, request_timeout=0.5, part_size_bytes=PART_BYTES,
                authority=authority().public_key(), attest=receipts.note_attestation,
            ))
            averagers[-1].receipts = receipts  # read in this process: the averager's writes the file
        yield averagers
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
        gc.collect()  # so hivemind's leftovers are reported here, under this module's warning filter
        deadline = time.monotonic() + 10
        while _new_processes(before) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _new_processes(before), "hivemind processes outlived the test"


def _new_processes(before: set[int]) -> list[int]:
    return [pid for pid in descendants() if pid not in before and not _is_torch_shm_manager(pid)]


def average_once(averagers, weights, seed, attempts: int = 3):
    """One complete round over fresh seeded vectors; returns (expected weighted mean, results, outcomes by peer id).

    hivemind 1.1.12 now and then loses a part on loopback ("received 99% results": the peer keeps its own values
    there); the benches count such a round as failed (docs/benchmarks.md#reference-figures), and so does this
    test: it tries again with fresh vectors.
    """
    for attempt in range(attempts):
        expected, results, outcomes = _average(averagers, weights, seed + 1000 * attempt)
        if all(outcome.complete for outcome in outcomes.values()):
            break
    return expected, results, outcomes


def _average(averagers, weights, seed):
    generator = torch.Generator().manual_seed(seed)
    vectors = [torch.randn(ELEMENTS, generator=generator) for _ in averagers]
    for averager, vector in zip(averagers, vectors):
        with averager.get_tensors() as (tensor,):
            tensor.copy_(vector)
    controls = [averager.step(weight=w, wait=False, timeout=30) for averager, w in zip(averagers, weights)]
    for control in controls:
        assert control.result(timeout=60) is not None, "the group did not form"
    expected = sum(w * v for w, v in zip(weights, vectors)) / sum(weights)
    results = []
    for averager in averagers:
        with averager.get_tensors() as (tensor,):
            results.append(tensor.clone())
    outcomes = {str(averager.peer_id): averager.last_round(timeout=10) for averager in averagers}
    finished = {str(averager.peer_id): averager.finished_round(timeout=10) for averager in averagers}
    # the report's source (averaging.planning) is the same round once it has ended
    assert all(finished[peer].group == outcomes[peer].group and finished[peer].ended > 0 for peer in outcomes)
    return expected, results, outcomes


def ids(averagers) -> list[str]:
    return [str(averager.peer_id) for averager in averagers]


def payload_bytes(outcome: RoundOutcome) -> int:
    """The fp32 bytes one member of an uncompressed round moves each way: the vector less its own share goes to the
    other aggregators and comes back averaged, and each other member's copy of its share comes in and goes back."""
    others = len(outcome.peer_ids) - 1
    return 4 * (outcome.total_elements - outcome.aggregated_elements + others * outcome.aggregated_elements)


@pytest.mark.parametrize("shares", [(0.6, 0.3, 0.1), (0.7, 0.3, 0.0)], ids=["60-30-10", "with-a-zero-share"])
def test_a_plan_splits_the_vector_as_given_and_keeps_the_exact_weighted_mean(three_averagers, shares):
    plan = dict(zip(ids(three_averagers), shares))
    for averager in three_averagers:
        averager.set_plan(signed_plan(plan))
    expected, results, outcomes = average_once(three_averagers, weights=(1.0, 2.0, 3.0), seed=round(shares[-1] * 10))
    for result in results:
        torch.testing.assert_close(result, expected, atol=1e-6, rtol=0)
    for peer, share in plan.items():
        outcome: RoundOutcome = outcomes[peer]
        # a planned group streams results to its zero-share peer too (no hold-back), and the mean stays exact
        assert outcome.planned and outcome.complete and outcome.streamed, outcome
        # ... sending each aggregator at most a window of parts ahead of its results (60 parts to the first here)
        assert 1 <= outcome.most_in_flight <= IN_FLIGHT_PARTS, outcome
        assert dict(zip(outcome.peer_ids, outcome.fractions)) == pytest.approx(plan)
        # the shares fall on part boundaries here, so hivemind's part-wise split hits them to the element
        assert abs(outcome.aggregated_elements - share * ELEMENTS) <= 1, (peer, outcome.aggregated_elements)
        # what the round moved over this peer's links, as its link report tells the planner
        assert (outcome.transfers.sent, outcome.transfers.received) == (payload_bytes(outcome),) * 2, (peer, outcome)
    # 60-30-10: the first peer moves 4 * (40,000 + 2 * 60,000) bytes each way, the last 4 * (90,000 + 2 * 10,000)
    sent = [outcomes[peer].transfers.sent for peer in plan]
    assert sent == [4 * (ELEMENTS + (len(plan) - 2) * round(share * ELEMENTS)) for share in shares]


def test_a_peer_the_plan_does_not_name_gets_an_equal_fraction_and_without_a_plan_all_do(three_averagers):
    first, second, third = ids(three_averagers)
    for averager in three_averagers:
        averager.set_plan(signed_plan({first: 0.5, second: 0.25}))  # the third peer is not in the plan
    expected, results, outcomes = average_once(three_averagers, weights=(1.0, 1.0, 1.0), seed=7)
    for result in results:
        torch.testing.assert_close(result, expected, atol=1e-6, rtol=0)
    # the third peer gets a third (in whole elements: 33,333 of 100,000); the planned two split the rest 2:1
    fractions = dict(zip(outcomes[first].peer_ids, outcomes[first].fractions))
    assert fractions == pytest.approx({first: 4 / 9, second: 2 / 9, third: 1 / 3}, abs=1 / ELEMENTS)

    for averager in three_averagers:
        averager.set_plan(None)
    for averager in three_averagers:  # a bandwidth announced: hivemind would give the first peer all of it
        averager.bandwidth = 1e9 if averager is three_averagers[0] else 1.0
    try:
        expected, results, outcomes = average_once(three_averagers, weights=(1.0, 1.0, 1.0), seed=8)
    finally:
        for averager in three_averagers:
            averager.bandwidth = None
    for result in results:
        torch.testing.assert_close(result, expected, atol=1e-6, rtol=0)
    # hivemind's runner, hold-back included and no window
    assert not outcomes[first].planned and not outcomes[first].streamed and outcomes[first].most_in_flight is None
    assert outcomes[first].fractions == pytest.approx([1 / 3] * 3, abs=1 / ELEMENTS)
    # ... which counts what it moved too
    for peer, outcome in outcomes.items():
        assert (outcome.transfers.sent, outcome.transfers.received) == (payload_bytes(outcome),) * 2, (peer, outcome)


def test_members_on_plans_of_different_versions_split_by_the_newest_and_average_exactly(three_averagers):
    first, second, third = ids(three_averagers)
    old = signed_plan({first: 0.5, second: 0.25, third: 0.25}, issued_at=1000.0)
    new = signed_plan({first: 0.2, second: 0.4, third: 0.4}, issued_at=2000.0)
    for averager, plan in zip(three_averagers, (new, old, old)):  # two have not read the new plan yet
        averager.set_plan(plan)
    expected, results, outcomes = average_once(three_averagers, weights=(1.0, 2.0, 3.0), seed=9)
    for result in results:
        torch.testing.assert_close(result, expected, atol=1e-6, rtol=0)
    for outcome in outcomes.values():
        assert outcome.complete and outcome.left_out == {}, outcome
        assert dict(zip(outcome.peer_ids, outcome.fractions)) == pytest.approx(new.shares)


def average_with_a_liar(averagers, liar, lie: float, plan: PlanRecord, seed: int, attempts: int = 3):
    """Rounds where ``liar`` announces ``lie`` as its share under ``plan``, until the honest members' round went
    through whole; returns (the honest members' expected weighted mean, the vectors, results, outcomes by peer id,
    what the liar's step raised)."""
    liar._announcement = lambda gather: [PLAN_MARKER, lie, plan.dict(), gather]  # step runs in this process
    weights = (1.0, 2.0, 3.0)
    try:
        for attempt in range(attempts):
            generator = torch.Generator().manual_seed(seed + 1000 * attempt)
            vectors = [torch.randn(ELEMENTS, generator=generator) for _ in averagers]
            for averager, vector in zip(averagers, vectors):
                with averager.get_tensors() as (tensor,):
                    tensor.copy_(vector)
            controls = [averager.step(weight=w, wait=False, timeout=30, allow_retries=averager is not liar)
                        for averager, w in zip(averagers, weights)]
            raised = None
            for averager, control in zip(averagers, controls):
                try:
                    control.result(timeout=60)
                except Exception as e:  # the liar's step; an honest member's fails the test below
                    raised = e if averager is liar else pytest.fail(f"an honest member's round failed: {e!r}")
            honest = [(w, v) for averager, w, v in zip(averagers, weights, vectors) if averager is not liar]
            expected = sum(w * v for w, v in honest) / sum(w for w, _ in honest)
            results = []
            for averager in averagers:
                with averager.get_tensors() as (tensor,):
                    results.append(tensor.clone())
            outcomes = {str(a.peer_id): a.last_round(timeout=10) for a in averagers}
            if all(outcomes[str(a.peer_id)].complete for a in averagers if a is not liar):
                break
        return expected, vectors, results, outcomes, raised
    finally:
        del liar._announcement


@pytest.mark.parametrize("lie", [1e9, 0.0], ids=["1e9", "zero-while-planned"])
def test_a_member_announcing_another_share_is_left_out_reported_and_the_others_average_exactly(three_averagers,
                                                                                                lie):
    first, second, third = ids(three_averagers)
    liar = three_averagers[2]
    plan = signed_plan({first: 0.5, second: 0.25, third: 0.25})
    for averager in three_averagers:
        averager.set_plan(plan)
        averager.receipts.drain(), averager.receipts.take_attested()  # earlier rounds'
    expected, vectors, results, outcomes, raised = average_with_a_liar(three_averagers, liar, lie, plan, seed=13)
    # the honest two averaged their own vectors exactly, the liar's parts refused, and the liar kept its vector
    for result in results[:2]:
        torch.testing.assert_close(result, expected, atol=1e-6, rtol=0)
    assert torch.equal(results[2], vectors[2])
    assert raised is not None and "left out of the round" in str(raised), raised
    for peer in (first, second):
        outcome = outcomes[peer]
        assert outcome.complete and outcome.planned and list(outcome.left_out) == [third], outcome
        assert f"announced share {lie!r} where its plan" in outcome.left_out[third]
        assert dict(zip(outcome.peer_ids, outcome.fractions)) == pytest.approx({first: 2 / 3, second: 1 / 3,
                                                                                 third: 0.0})
    # reported as a cut sender is: an attestation that rides in the member's next metrics record
    for averager in three_averagers[:2]:
        _, aggregated = averager.receipts.drain()
        attested = averager.receipts.take_attested()
        assert len(attested) == 1, attested
        (notes,) = attested.values()
        note = Attestation.parse_obj(notes[third])
        assert note.left_out == outcomes[str(averager.peer_id)].left_out[third] and note.weight == 0.0
        assert all(third not in senders for senders in aggregated.values()), aggregated  # no receipt for it


def test_the_averagers_process_keeps_what_it_inherited_out_of_the_collector(three_averagers):
    """Pitfall 13: a full collection in a forked averager wrote to every inherited object and stalled the round
    that had just begun for 0.3-0.5 s (docs/hivemind.md#pitfalls). Unfrozen, the count is 0; torch and hivemind
    alone are some 10^5 objects."""
    for averager in three_averagers:
        assert averager.frozen_objects(timeout=10) > 50_000


def test_averagers_meet_only_under_the_same_group_key(three_averagers):
    """How a plan's groups reach the swarm (docs/averaging.md#groups): an averager looks for a group under its
    group key only, so peers the plan puts in different groups never meet, and the same bits bring them together."""

    def outcome(control):
        try:
            return control.result(timeout=60)
        except Exception:  # hivemind's "could not find a group"
            return None

    try:
        for averager, bits in zip(three_averagers, ("0", "0", "1")):
            averager.set_group_bits(bits)
        controls = [averager.step(weight=1.0, wait=False, timeout=4) for averager in three_averagers]
        assert [outcome(control) for control in controls] == [None] * 3  # min_group_size is 3: no group of 2
        for averager in three_averagers:
            averager.set_group_bits("1")
            averager.set_plan(None)
        expected, results, outcomes = average_once(three_averagers, weights=(1.0, 1.0, 1.0), seed=11)
        assert all(o.complete and len(o.peer_ids) == 3 for o in outcomes.values())
        for result in results:
            torch.testing.assert_close(result, expected, atol=1e-6, rtol=0)
    finally:
        for averager in three_averagers:
            averager.set_group_bits("")


def test_state_is_averaged_every_step_once_the_swarm_averages_gradients_in_groups():
    from dedloc_worker.training.options import state_averaging_period

    # within one group every peer takes the same step: the run's period holds
    assert [state_averaging_period(n, group_size=8, configured=10) for n in (1, 2, 8)] == [10, 10, 10]
    # beyond it, gradient groups take different steps and only state averaging mixes them
    assert [state_averaging_period(n, group_size=8, configured=10) for n in (9, 100)] == [1, 1]
    assert state_averaging_period(2, group_size=8, configured=1) == 1


def test_a_part_waits_up_to_the_sender_timeout_for_its_group_to_be_registered():
    """A sender's part can come before this peer registers its group (under delayed updates, until its previous
    round and step are done); turned away after a matchmaking time, its sender lost that share and this peer waited
    out the sender timeout, late for its next round too (docs/benchmarks.md#delayed-parameter-updates)."""
    peer = SimpleNamespace(matchmaking_kwargs={"min_matchmaking_time": 0.1, "request_timeout": 0.05},
                           next_chunk_timeout=5.0, _running_groups={})

    async def register_later(group_id: bytes, seconds: float) -> None:
        await asyncio.sleep(seconds)
        peer._running_groups[group_id] = asyncio.get_running_loop().create_future()

    async def part_for(group_id: bytes, registered_after: float) -> bool:
        registering = asyncio.create_task(register_later(group_id, registered_after))
        await PlannedAverager._wait_for_group(peer, group_id)
        found = group_id in peer._running_groups
        registering.cancel()
        return found

    # registered well past the matchmaking time and the request timeout, within the sender timeout: accepted
    assert asyncio.run(part_for(b"late", 0.6))
    peer.next_chunk_timeout = 0.2  # control: a group that comes after the sender timeout is not waited for
    assert not asyncio.run(part_for(b"later", 1.0))
