"""A worker's claims until the coordinator has them: nothing is lost while the coordinator is down.

As epochs close the training loop publishes a metrics record with its newest claims (``swarm.records.publish_metrics``,
at most every ``swarm.records.METRICS_INTERVAL`` seconds).
The ``ClaimOutbox`` of the worker's process keeps every claim the coordinator has not acknowledged yet, each with
the members of its all-reduce round (``credit.receipts.ReceiptLog.members_of``), so the coordinator can tell who was
there, and puts the oldest of them in the record instead of the training loop's list. The ``ClaimKeeper`` thread
reads the coordinator's acknowledgement for this peer key (signed by the run's authority: ``contract.AckRecord``),
drops the claims it covers, and republishes the record before it expires, also while no epoch closes (a paused
run, a stalled swarm).

The bound. The outbox holds up to ``CLAIMS_HELD`` (7,200) claims and ``CLAIMS_HELD_BYTES`` (16 MiB of JSON) in the
worker's memory: two hours at 1 s per epoch, four at 2 s (a claim of a round of 8 is about 1.2 KB, so the count
binds first). Past that the oldest claims' attestations go, then the oldest claims, with a line in the worker's
output. A record carries only the oldest unacknowledged claims that fit ``contract.PENDING_CLAIMS_KEPT`` (256) and
``PENDING_CLAIMS_BYTES`` (48 KiB): every peer's record lives under one DHT key, which the coordinator reads in one
reply. Those are a prefix of what is held, so the coordinator's acknowledgement (the newest epoch its database
holds) covers exactly what it read; each acknowledgement moves the record on to the next oldest claims, the keeper
checking every ``BACKLOG_INTERVAL`` seconds while claims wait beyond the record. A coordinator back after an hour at
1.8 s per epoch (2,000 claims, 40 to 80 a record) reads them all in 25 to 50 polls, a few minutes; until then the
record does not carry the newest claim (the dashboard's loss and spot checks wait for it).

What it cannot keep: the claims of a worker that leaves (or restarts) while the coordinator is down live in the DHT
for one record lifetime (``swarm.records.metrics_ttl``) after it leaves, and only those that were in its record.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Dict, List, Optional

from dedloc_common.contract import PENDING_CLAIMS_BYTES, PENDING_CLAIMS_KEPT, EpochContribution, MetricsRecord

from dedloc_worker.errors import DHT_FAILURES

# How many unacknowledged claims, and bytes of them (JSON), a worker holds in memory; the record carries the oldest.
CLAIMS_HELD = 7200
CLAIMS_HELD_BYTES = 16 * 1024 * 1024
# How often (seconds) the keeper looks for an acknowledgement while held claims wait beyond the record.
BACKLOG_INTERVAL = 1.0


class ClaimOutbox:
    """This peer's unacknowledged claims by epoch, and the record last published with them.

    :param receipts: the ``ReceiptLog`` that knows the members of this peer's rounds (None: members stay as given)
    :param kept: at most this many claims in a record, ``max_bytes`` of them (JSON; at least the oldest one)
    :param held: at most this many claims held until acknowledged, ``held_bytes`` of them
    """

    def __init__(self, receipts=None, kept: int = PENDING_CLAIMS_KEPT, max_bytes: int = PENDING_CLAIMS_BYTES,
                 held: int = CLAIMS_HELD, held_bytes: int = CLAIMS_HELD_BYTES):
        self.lock = threading.RLock()
        self.receipts, self.kept, self.max_bytes = receipts, kept, max_bytes
        self.held, self.held_bytes = held, held_bytes
        self.pending: Dict[int, EpochContribution] = {}
        self._sizes: Dict[int, int] = {}
        self._bytes = 0  # sum of _sizes
        self.acknowledged = -1  # every claim up to this epoch is in the coordinator's database
        self.newest: Optional[EpochContribution] = None
        self.record: Optional[MetricsRecord] = None  # the record as last published
        self.published_at = 0.0  # time.monotonic() of the last publication the DHT accepted
        self.dropped = 0
        self.backlog = 0  # held claims the record could not carry

    def outgoing(self, record: MetricsRecord) -> MetricsRecord:
        """``record`` with the oldest unacknowledged claims (its own new ones added) instead of its ``recent``."""
        with self.lock:
            for claim in record.recent:
                if claim.epoch <= self.acknowledged or claim.epoch in self.pending:
                    continue
                if not claim.members and claim.group and self.receipts is not None:
                    claim = claim.copy(update={"members": self.receipts.members_of(claim.group)})
                self._hold(claim)
                if self.newest is None or claim.epoch >= self.newest.epoch:
                    self.newest = claim
            self._cap()
            self.record = record.copy(update={"recent": self.claims()})
            return self.record

    def claims(self) -> List[EpochContribution]:
        """What a record carries: the oldest unacknowledged claims, as many as fit its caps, and, when they are all
        there, the newest claim even when acknowledged (its loss is the swarm's latest on the dashboard). Only a
        prefix of the unacknowledged claims: an acknowledgement of the newest epoch in it covers every older one."""
        with self.lock:
            found, size = [], 0
            for epoch in sorted(self.pending):
                if found and (len(found) >= self.kept or size + self._sizes[epoch] > self.max_bytes):
                    break
                found.append(self.pending[epoch])
                size += self._sizes[epoch]
            self.backlog = len(self.pending) - len(found)
            if not self.backlog and self.newest is not None and self.newest.epoch not in self.pending:
                found.append(self.newest)
            return found

    def published(self, accepted: bool) -> bool:
        if accepted:
            self.published_at = time.monotonic()
        return accepted

    def acknowledge(self, epoch: int) -> bool:
        """The coordinator holds every claim up to ``epoch``: forget them. True when that changed anything."""
        with self.lock:
            if epoch <= self.acknowledged:
                return False
            self.acknowledged = epoch
            for done in [e for e in self.pending if e <= epoch]:
                self._forget(done)
            if self.record is not None:
                self.record = self.record.copy(update={"recent": self.claims()})
            return True

    def _hold(self, claim: EpochContribution) -> None:
        if claim.epoch in self.pending:
            self._bytes -= self._sizes[claim.epoch]
        self.pending[claim.epoch] = claim
        self._sizes[claim.epoch] = len(json.dumps(claim.dict()))
        self._bytes += self._sizes[claim.epoch]

    def _forget(self, epoch: int) -> None:
        del self.pending[epoch]
        self._bytes -= self._sizes.pop(epoch)

    def _cap(self) -> None:
        # attestations go first, oldest first: they are evidence; the receipts (``aggregated``) carry the credit
        if self._bytes > self.held_bytes:
            for epoch in sorted(self.pending):
                if self._bytes <= self.held_bytes:
                    break
                if self.pending[epoch].attested:
                    self._hold(self.pending[epoch].copy(update={"attested": {}}))
        while self.pending and (len(self.pending) > self.held or self._bytes > self.held_bytes):
            oldest = min(self.pending)
            self._forget(oldest)
            self.dropped += 1
            print(f"claims: the coordinator has not acknowledged {len(self.pending) + 1} claims; dropped the oldest "
                  f"(epoch {oldest}) to hold at most {self.held:,} claims and {self.held_bytes:,} bytes of them",
                  flush=True)


class ClaimKeeper(threading.Thread):
    """Main-process thread: applies the coordinator's acknowledgements to the outbox and keeps this peer's metrics
    record alive in the DHT (republished at a third of its lifetime, and when an acknowledgement shrank it, unless a
    record went out within ``interval``: while the peer trains, its next record carries the shrink anyway).

    :param check: the run's ``admission.gate.TokenCheck`` (its authority key verifies acknowledgements)
    """

    def __init__(self, dht, run_id: str, signature, check, outbox: ClaimOutbox, interval: Optional[float] = None):
        from dedloc_common.contract import peer_key_of_subkey

        from dedloc_worker.swarm.records import metrics_ttl

        super().__init__(name="dedloc-claims", daemon=True)
        self.dht, self.run_id, self.signature, self.check, self.outbox = dht, run_id, signature, check, outbox
        self.peer_key = peer_key_of_subkey(signature.local_public_key)
        self.ttl = metrics_ttl()
        self.interval = interval if interval is not None else min(5.0, self.ttl / 6)
        self.halted = threading.Event()
        self.shrunk_at = float("-inf")  # when an acknowledgement last shrank the outbox

    def run(self) -> None:
        while not self.halted.wait(min(self.interval, BACKLOG_INTERVAL) if self.outbox.backlog else self.interval):
            try:
                self.tick()
            except DHT_FAILURES as e:  # the DHT briefly unavailable: the record still lives, try again
                if not self.halted.is_set():
                    print(f"claims: {type(e).__name__}: {e}; retrying", flush=True)

    def tick(self) -> None:
        from dedloc_worker.swarm.records import read_ack, store_metrics

        epoch = read_ack(self.dht, self.run_id, self.peer_key, self.check)
        if epoch is not None and self.outbox.acknowledge(epoch):
            self.shrunk_at = time.monotonic()
        if self.halted.is_set():  # leaving: the DHT is about to shut down, so no new call to it
            return
        with self.outbox.lock:
            since = time.monotonic() - self.outbox.published_at
            unsent_shrink = self.outbox.published_at < self.shrunk_at and since >= self.interval
            if self.outbox.record is not None and (unsent_shrink or since > self.ttl / 3):
                self.outbox.published(store_metrics(self.dht, self.run_id, self.signature, self.outbox.record))

    def halt(self, timeout: float = 10.0) -> None:
        """Stop before the DHT shuts down (the thread uses it); wait at most ``timeout`` seconds."""
        self.halted.set()
        self.join(timeout=timeout)
