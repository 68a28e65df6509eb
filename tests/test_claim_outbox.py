"""A worker keeps every claim until the coordinator acknowledges it, its record carrying the oldest of them, and the
record alive (dedloc_worker.credit.outbox): the outbox's bound on its own (an hour of claims, no DHT), then on real
hivemind DHT nodes in this process, with an acknowledgement signed by a run's authority key and one signed by
another key."""

from __future__ import annotations

import gc
import json
import threading
import time
from collections import deque

import pytest
from dedloc_common.contract import (
    PENDING_CLAIMS_BYTES,
    PENDING_CLAIMS_KEPT,
    RECENT_EPOCHS_KEPT,
    AckRecord,
    EpochContribution,
    MetricsRecord,
    ack_payload,
    encode_sketch,
    peer_key_of_subkey,
)
from dedloc_common.signing import new_private_key, public_openssh, sign
from dedloc_worker.admission.gate import TokenCheck
from dedloc_worker.credit.outbox import CLAIMS_HELD, ClaimKeeper, ClaimOutbox
from dedloc_worker.credit.receipts import ReceiptLog
from dedloc_worker.swarm.node import create_dht
from dedloc_worker.swarm.records import (
    MetricsPublisher,
    add_record_validators,
    publish_acks,
    publish_metrics,
    read_metrics,
)
from hivemind.utils.crypto import RSAPrivateKey

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
RUN = "outbox"
GROUP = "ab" * 8


def contribution(epoch: int, group: str = "") -> EpochContribution:
    return EpochContribution(epoch=epoch, samples=10 + epoch, loss_sum=1.0, mini_steps=1, seconds=1.0, group=group)


def record_of(recent) -> MetricsRecord:
    return MetricsRecord(username="alice", epoch=99, samples_per_second=1.0, time=time.time(), recent=list(recent))


def test_a_record_from_a_worker_before_members_still_parses():
    old = {"epoch": 1, "samples": 5, "loss_sum": 1.0, "mini_steps": 1, "seconds": 1.0, "group": GROUP}
    assert EpochContribution.parse_obj(old).members == []


def full_claim(epoch: int, size: int = 8) -> EpochContribution:
    """A claim as a worker in a round of ``size`` sends it: the round's members, receipts for every other member's
    part, a gradient sketch, seconds computing and bytes sent (about 1.3 KB of JSON for 8)."""
    members = [f"12D3KooWPeer{epoch % 97:02d}x{i:02d}" + "A" * 32 for i in range(size)]
    group = f"{epoch:032x}"
    return EpochContribution(epoch=epoch, samples=2048 + epoch % 7, loss_sum=12.3456789 + epoch, mini_steps=64,
                             seconds=1.8, group=group, aggregated={group: {m: 2048.0 for m in members[1:]}},
                             members=members, sketch=encode_sketch([0.1] * 64), compute_seconds=1.234,
                             sent_bytes=1_234_567)


def test_the_outbox_keeps_what_is_not_acknowledged_within_its_caps(tmp_path):
    receipts = ReceiptLog(tmp_path)
    receipts.note_round(bytes.fromhex(GROUP), ["QmA", "QmB"])
    receipts.drain()
    outbox = ClaimOutbox(receipts, kept=5, held=6)
    recent = deque(maxlen=3)  # the training loop hands over its last few only
    for epoch in range(8):
        recent.append(contribution(epoch, GROUP if epoch == 7 else ""))
        sent = outbox.outgoing(record_of(recent))
    # six held (the oldest two dropped), the record carries the oldest five of them
    assert sorted(outbox.pending) == [2, 3, 4, 5, 6, 7] and outbox.dropped == 2 and outbox.backlog == 1
    assert [c.epoch for c in sent.recent] == [2, 3, 4, 5, 6]
    assert outbox.pending[7].members == ["QmA", "QmB"] and sent.recent[0].members == []
    assert outbox.acknowledge(5) and not outbox.acknowledge(4)
    assert [c.epoch for c in outbox.record.recent] == [6, 7] and outbox.backlog == 0
    assert outbox.record.recent[-1].members == ["QmA", "QmB"]
    assert outbox.acknowledge(7) and [c.epoch for c in outbox.record.recent] == [7]  # the newest stays, for its loss
    tight = ClaimOutbox(held_bytes=3 * len(contribution(0).json()))
    for epoch in range(6):
        tight.outgoing(record_of([contribution(epoch)]))
    assert len(tight.pending) < 6 and max(tight.pending) == 5
    narrow = ClaimOutbox(max_bytes=10)  # a claim larger than a record's bytes still goes, alone
    assert [c.epoch for c in narrow.outgoing(record_of([contribution(0), contribution(1)])).recent] == [0]


def test_an_hour_of_claims_without_a_coordinator_all_reach_it_when_it_returns():
    """The bound: a coordinator down for an hour at 1 s per epoch (3,600 claims of rounds of 8, more than 4 MB)
    loses nothing. The record stays within its caps and carries the oldest claims; the coordinator stores what
    each record carries and acknowledges the newest epoch it holds, and every claim arrives, exactly as the worker
    made it. An acknowledgement drops what it covers and nothing else; the outbox holds two hours' worth before it
    drops any."""
    made = {epoch: full_claim(epoch) for epoch in range(3600)}
    outbox = ClaimOutbox()
    recent = deque(maxlen=RECENT_EPOCHS_KEPT)
    for epoch in range(3600):
        recent.append(made[epoch])
        sent = outbox.outgoing(record_of(recent))
    assert outbox.dropped == 0 and sorted(outbox.pending) == list(range(3600))
    assert sum(len(json.dumps(c.dict())) for c in made.values()) > 4_000_000
    assert [c.epoch for c in sent.recent] == list(range(len(sent.recent))) and outbox.backlog > 3000

    database, polls = {}, 0
    while outbox.backlog or max(database, default=-1) < 3599:
        record = outbox.record
        assert len(record.recent) <= PENDING_CLAIMS_KEPT
        assert sum(len(json.dumps(c.dict())) for c in record.recent) <= PENDING_CLAIMS_BYTES
        database.update({c.epoch: c for c in record.recent})
        if polls == 0:  # an acknowledgement drops exactly what it covers
            assert outbox.acknowledge(max(database)) and min(outbox.pending) == max(database) + 1
            assert len(outbox.pending) == 3600 - len(database)
        else:
            outbox.acknowledge(max(database))
        polls += 1
        assert polls < 200
    assert database == {epoch: made[epoch] for epoch in range(3600)}
    assert outbox.pending == {} and [c.epoch for c in outbox.record.recent] == [3599]  # the newest, for its loss
    assert polls <= 3600 * 1350 // PENDING_CLAIMS_BYTES + 1  # about 40 claims a record: a few minutes of polls

    for epoch in range(3600, CLAIMS_HELD + 3600):  # another outage: two hours' worth held, then the oldest go
        outbox.outgoing(record_of([full_claim(epoch)]))
    assert outbox.dropped == 0 and len(outbox.pending) == CLAIMS_HELD
    outbox.outgoing(record_of([full_claim(CLAIMS_HELD + 3600)]))
    assert outbox.dropped == 1 and min(outbox.pending) == 3601


@pytest.fixture
def worker_and_coordinator():
    coordinator = create_dht([], "/ip4/127.0.0.1/tcp/0", client_mode=False)
    worker = None
    try:
        worker = create_dht([str(a) for a in coordinator.get_visible_maddrs()], "/ip4/127.0.0.1/tcp/0",
                            client_mode=False)
        yield worker, coordinator
    finally:
        for dht in (worker, coordinator):
            if dht is not None:
                dht.shutdown()
        gc.collect()


@pytest.mark.swarm
def test_claims_stay_in_the_swarm_until_the_coordinators_signed_acknowledgement(worker_and_coordinator, tmp_path,
                                                                               monkeypatch):
    ttl = 3  # seconds a record lives; the keeper republishes after a third of it
    monkeypatch.setenv("DEDLOC_METRICS_TTL", str(ttl))
    worker, coordinator = worker_and_coordinator
    signature = add_record_validators(worker, RUN, RSAPrivateKey())
    coordinator_signature = add_record_validators(coordinator, RUN, RSAPrivateKey())
    authority = new_private_key()
    check = TokenCheck(public_openssh(authority).decode())
    peer_key = peer_key_of_subkey(signature.local_public_key)

    def acknowledge(epoch: int, key=authority) -> None:
        issued_at = time.time()
        ack = AckRecord(peer_key=peer_key, epoch=epoch, issued_at=issued_at,
                        signature=sign(key, ack_payload(peer_key, epoch, issued_at)))
        assert publish_acks(coordinator, RUN, coordinator_signature, [ack]) == 1

    def published() -> list[int]:
        return [c.epoch for m in read_metrics(coordinator, RUN) for c in m.record.recent]

    outbox = ClaimOutbox()
    keeper = ClaimKeeper(worker, RUN, signature, check, outbox, interval=0.5)
    try:
        recent = deque(maxlen=RECENT_EPOCHS_KEPT)
        for epoch in range(40):  # the coordinator is down: 40 epochs, more than the training loop repeats
            recent.append(contribution(epoch))
            assert publish_metrics(worker, RUN, signature, record_of(recent), outbox=outbox)
        assert published() == list(range(40))

        acknowledge(29, key=new_private_key())  # not the run's authority: changes nothing
        keeper.tick()
        assert published() == list(range(40))
        acknowledge(29)
        keeper.tick()  # a record went out less than an interval ago: the loop's next one would carry the shrink
        assert published() == list(range(40))
        time.sleep(keeper.interval)
        keeper.tick()  # none came: the keeper stores the shrunk record itself
        assert published() == list(range(30, 40))

        # Nothing new for three lifetimes: the keeper republishes; without it the record expires.
        keeper.start()
        time.sleep(3 * ttl)
        assert published() == list(range(30, 40))
        keeper.halt()
        time.sleep(1.5 * ttl)
        assert published() == []
    finally:
        keeper.halted.set()


@pytest.mark.swarm
def test_the_training_loop_hands_records_over_without_waiting_and_the_newest_reaches_the_coordinator(
        worker_and_coordinator):
    worker, coordinator = worker_and_coordinator
    signature = add_record_validators(worker, RUN, RSAPrivateKey())
    add_record_validators(coordinator, RUN, RSAPrivateKey())
    store_may_go, storing, said = threading.Event(), threading.Event(), []

    stored = []

    def publish(record):  # the first store is held until the loop has handed over every record
        storing.set()
        assert store_may_go.wait(30)
        stored.append(len(record.recent))
        return publish_metrics(worker, RUN, signature, record)

    publisher = MetricsPublisher(publish, say=said.append)
    recent = deque(maxlen=RECENT_EPOCHS_KEPT)
    try:
        for epoch in range(5):  # each submit returns while the store is held: none waited for it
            recent.append(contribution(epoch))
            publisher.submit(record_of(recent))
            assert storing.wait(10)
    finally:
        store_may_go.set()
        publisher.close()
    assert stored == [1, 5]  # the first record when released, then the newest: it replaced the three between
    assert [c.epoch for m in read_metrics(coordinator, RUN) for c in m.record.recent] == list(range(5))
    assert said == []


def test_records_are_stored_an_interval_apart_and_the_newest_goes():
    stored, said = [], []

    def publish(record):
        stored.append((record.epoch, time.monotonic()))

    publisher = MetricsPublisher(publish, say=said.append, interval=0.5)
    try:
        for epoch in range(1, 5):  # epochs 0.05 s apart: only the first and the newest are stored
            publisher.submit(MetricsRecord(username="alice", epoch=epoch, samples_per_second=1.0, time=time.time(),
                                           recent=[]))
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while len(stored) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        publisher.close()
    assert [epoch for epoch, _ in stored] == [1, 4]
    assert stored[1][1] - stored[0][1] >= 0.5
    assert said == []


def test_a_store_that_fails_is_one_line_and_the_next_record_still_goes():
    sent, said, tried = [], [], threading.Event()

    def publish(record):
        tried.set()
        if record.epoch == 1:
            raise ConnectionError("the DHT is shutting down")
        sent.append(record.epoch)

    publisher = MetricsPublisher(publish, say=said.append)
    publisher.submit(MetricsRecord(username="alice", epoch=1, samples_per_second=1.0, time=time.time(), recent=[]))
    assert tried.wait(10)
    publisher.submit(MetricsRecord(username="alice", epoch=2, samples_per_second=1.0, time=time.time(), recent=[]))
    publisher.close()
    assert sent == [2]
    assert len(said) == 1 and "ConnectionError: the DHT is shutting down" in said[0] and "\n" not in said[0]
