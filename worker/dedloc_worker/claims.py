"""A worker's claims until the coordinator has them: nothing is lost while the coordinator is down.

Every epoch the training loop publishes a metrics record with its newest claims (``records.publish_metrics``).
The ``ClaimOutbox`` of the worker's process adds to it every claim the coordinator has not acknowledged yet, each
with the members of its all-reduce round (``receipts.ReceiptLog.members_of``), so the coordinator can tell who was
there. The ``ClaimKeeper`` thread reads the coordinator's acknowledgement for this peer key (signed by the run's
authority: ``contract.AckRecord``), drops the claims it covers, and republishes the record before it expires, also
while no epoch closes (a paused run, a stalled swarm). A coordinator that comes back after any outage reads every
claim made meanwhile, up to the caps that keep the record small (``contract.PENDING_CLAIMS_KEPT`` and
``PENDING_CLAIMS_BYTES``; past them the oldest claims' attestations, then the oldest claims are dropped, with a
line in the worker's output).

What it cannot keep: the claims of a worker that leaves while the coordinator is down live in the DHT for one
record lifetime (``records.metrics_ttl``) after it leaves.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Dict, List, Optional

from dedloc_common.contract import PENDING_CLAIMS_BYTES, PENDING_CLAIMS_KEPT, EpochContribution, MetricsRecord


class ClaimOutbox:
    """This peer's unacknowledged claims by epoch, and the record last published with them.

    :param receipts: the ``ReceiptLog`` that knows the members of this peer's rounds (None: members stay as given)
    """

    def __init__(self, receipts=None, kept: int = PENDING_CLAIMS_KEPT, max_bytes: int = PENDING_CLAIMS_BYTES):
        self.lock = threading.RLock()
        self.receipts, self.kept, self.max_bytes = receipts, kept, max_bytes
        self.pending: Dict[int, EpochContribution] = {}
        self._sizes: Dict[int, int] = {}
        self.acknowledged = -1  # every claim up to this epoch is in the coordinator's database
        self.newest: Optional[EpochContribution] = None
        self.record: Optional[MetricsRecord] = None  # the record as last published
        self.published_at = 0.0  # time.monotonic() of the last publication the DHT accepted
        self.dropped = 0

    def outgoing(self, record: MetricsRecord) -> MetricsRecord:
        """``record`` with every unacknowledged claim (its own new ones added) instead of its ``recent`` list."""
        with self.lock:
            for claim in record.recent:
                if claim.epoch <= self.acknowledged or claim.epoch in self.pending:
                    continue
                if not claim.members and claim.group and self.receipts is not None:
                    claim = claim.copy(update={"members": self.receipts.members_of(claim.group)})
                self.pending[claim.epoch] = claim
                self._sizes[claim.epoch] = len(json.dumps(claim.dict()))
                if self.newest is None or claim.epoch >= self.newest.epoch:
                    self.newest = claim
            self._cap()
            self.record = record.copy(update={"recent": self.claims()})
            return self.record

    def claims(self) -> List[EpochContribution]:
        """The unacknowledged claims, oldest first, and the newest claim even when acknowledged (its loss is the
        swarm's latest on the dashboard)."""
        with self.lock:
            found = [self.pending[epoch] for epoch in sorted(self.pending)]
            if self.newest is not None and self.newest.epoch not in self.pending:
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
                del self.pending[done], self._sizes[done]
            if self.record is not None:
                self.record = self.record.copy(update={"recent": self.claims()})
            return True

    def _cap(self) -> None:
        for epoch in sorted(self.pending):  # attestations go first, oldest first: they are evidence, not credit
            if sum(self._sizes.values()) <= self.max_bytes:
                break
            if self.pending[epoch].attested:
                self.pending[epoch] = self.pending[epoch].copy(update={"attested": {}})
                self._sizes[epoch] = len(json.dumps(self.pending[epoch].dict()))
        while self.pending and (len(self.pending) > self.kept or sum(self._sizes.values()) > self.max_bytes):
            oldest = min(self.pending)
            del self.pending[oldest], self._sizes[oldest]
            self.dropped += 1
            print(f"claims: the coordinator has not acknowledged {len(self.pending) + 1} claims; dropped the oldest "
                  f"(epoch {oldest}) to keep the metrics record small", flush=True)


class ClaimKeeper(threading.Thread):
    """Main-process thread: applies the coordinator's acknowledgements to the outbox and keeps this peer's metrics
    record alive in the DHT (republished at a third of its lifetime, and at once when an acknowledgement shrank
    it).

    :param check: the run's ``admission.TokenCheck`` (its authority key verifies acknowledgements)
    """

    def __init__(self, dht, run_id: str, signature, check, outbox: ClaimOutbox, interval: Optional[float] = None):
        from dedloc_common.contract import peer_key_of_subkey

        from .records import metrics_ttl

        super().__init__(name="dedloc-claims", daemon=True)
        self.dht, self.run_id, self.signature, self.check, self.outbox = dht, run_id, signature, check, outbox
        self.peer_key = peer_key_of_subkey(signature.local_public_key)
        self.ttl = metrics_ttl()
        self.interval = interval if interval is not None else min(5.0, self.ttl / 6)
        self.halted = threading.Event()

    def run(self) -> None:
        while not self.halted.wait(self.interval):
            try:
                self.tick()
            except Exception as e:  # the DHT briefly unavailable: the record still lives, try again
                if not self.halted.is_set():
                    print(f"claims: {type(e).__name__}: {e}; retrying", flush=True)

    def tick(self) -> None:
        from .records import read_ack, store_metrics

        epoch = read_ack(self.dht, self.run_id, self.peer_key, self.check)
        shrank = epoch is not None and self.outbox.acknowledge(epoch)
        if self.halted.is_set():  # leaving: the DHT is about to shut down, so no new call to it
            return
        with self.outbox.lock:
            due = time.monotonic() - self.outbox.published_at > self.ttl / 3
            if self.outbox.record is not None and (shrank or due):
                self.outbox.published(store_metrics(self.dht, self.run_id, self.signature, self.outbox.record))

    def halt(self, timeout: float = 10.0) -> None:
        """Stop before the DHT shuts down (the thread uses it); wait at most ``timeout`` seconds."""
        self.halted.set()
        self.join(timeout=timeout)
