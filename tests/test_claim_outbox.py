"""A worker keeps every claim in its metrics record, and the record alive, until the coordinator acknowledges it
(dedloc_worker.claims): on real hivemind DHT nodes in this process, with an acknowledgement signed by a run's
authority key and one signed by another key."""

from __future__ import annotations

import gc
import time
from collections import deque

import pytest
from dedloc_common.contract import (RECENT_EPOCHS_KEPT, AckRecord, EpochContribution, MetricsRecord, ack_payload,
                                   peer_key_of_subkey)
from dedloc_common.signing import new_private_key, public_openssh, sign
from dedloc_worker.admission import TokenCheck
from dedloc_worker.claims import ClaimKeeper, ClaimOutbox
from dedloc_worker.receipts import ReceiptLog
from dedloc_worker.records import add_record_validators, publish_acks, publish_metrics, read_metrics, use_outbox
from dedloc_worker.swarm import create_dht
from hivemind.utils.crypto import RSAPrivateKey

pytestmark = [
    pytest.mark.swarm,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]
RUN = "outbox"
GROUP = "ab" * 8


def contribution(epoch: int, group: str = "") -> EpochContribution:
    return EpochContribution(epoch=epoch, samples=10 + epoch, loss_sum=1.0, mini_steps=1, seconds=1.0, group=group)


def record_of(recent) -> MetricsRecord:
    return MetricsRecord(username="alice", epoch=99, samples_per_second=1.0, time=time.time(), recent=list(recent))


def test_a_record_from_a_worker_before_members_still_parses():
    old = {"epoch": 1, "samples": 5, "loss_sum": 1.0, "mini_steps": 1, "seconds": 1.0, "group": GROUP}
    assert EpochContribution.parse_obj(old).members == []


def test_the_outbox_keeps_what_is_not_acknowledged_within_its_caps(tmp_path):
    receipts = ReceiptLog(tmp_path)
    receipts.note_round(bytes.fromhex(GROUP), ["QmA", "QmB"])
    receipts.drain()
    outbox = ClaimOutbox(receipts, kept=5)
    recent = deque(maxlen=3)  # the training loop hands over its last few only
    for epoch in range(8):
        recent.append(contribution(epoch, GROUP if epoch == 7 else ""))
        sent = outbox.outgoing(record_of(recent))
    assert [c.epoch for c in sent.recent] == [3, 4, 5, 6, 7] and outbox.dropped == 3
    assert sent.recent[-1].members == ["QmA", "QmB"] and sent.recent[0].members == []
    assert outbox.acknowledge(6) and not outbox.acknowledge(5)
    assert [c.epoch for c in outbox.record.recent] == [7]
    assert outbox.acknowledge(7) and [c.epoch for c in outbox.record.recent] == [7]  # the newest stays, for its loss
    tight = ClaimOutbox(max_bytes=3 * len(contribution(0).json()))
    for epoch in range(6):
        tight.outgoing(record_of([contribution(epoch)]))
    assert len(tight.pending) < 6 and max(tight.pending) == 5


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


def test_claims_stay_in_the_swarm_until_the_coordinators_signed_acknowledgement(worker_and_coordinator, tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("DEDLOC_METRICS_TTL", "4")
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
    use_outbox(signature, outbox)
    keeper = ClaimKeeper(worker, RUN, signature, check, outbox, interval=0.5)
    try:
        recent = deque(maxlen=RECENT_EPOCHS_KEPT)
        for epoch in range(40):  # the coordinator is down: 40 epochs, more than the training loop repeats
            recent.append(contribution(epoch))
            assert publish_metrics(worker, RUN, signature, record_of(recent))
        assert published() == list(range(40))

        acknowledge(29, key=new_private_key())  # not the run's authority: changes nothing
        keeper.tick()
        assert published() == list(range(40))
        acknowledge(29)
        keeper.tick()
        assert published() == list(range(30, 40))

        # Nothing new for three lifetimes: the keeper republishes; without it the record expires.
        keeper.start()
        time.sleep(12)
        assert published() == list(range(30, 40))
        keeper.halt()
        time.sleep(6)
        assert published() == []
    finally:
        use_outbox(signature, None)
        keeper.halted.set()
