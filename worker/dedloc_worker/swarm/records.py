"""Signed DHT records of a run: hivemind's progress records, dedloc's metrics, tokens, denylist, plan and the
coordinator's acknowledgements of claims.

Writers sign with the process's RSA key (the record's subkey is the owner's public key, so no peer can overwrite
another's record). Readers must register the same validators, or ``get`` on a signed key never resolves
(docs/hivemind.md#pitfalls, pitfall 5): ``add_record_validators`` is the one place that does it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import pydantic.v1 as pydantic_v1
from dedloc_common.contract import (
    AckRecord,
    MetricsRecord,
    PlanRecord,
    ack_key,
    ack_payload,
    ceiling_payload,
    denylist_key,
    denylist_payload,
    metrics_key,
    peer_key_of_subkey,
    plan_key,
    plan_payload,
    progress_key,
    tokens_key,
)
from google.protobuf.message import DecodeError
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress, TrainingProgressSchema
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import get_dht_time

from dedloc_worker.errors import DHT_FAILURES

# How long a metrics record lives in the DHT (seconds) after its last publication. A worker republishes its record
# while claims in it wait for the coordinator's acknowledgement (dedloc_worker.credit.outbox), so an outage longer than
# this loses nothing; DEDLOC_METRICS_TTL changes it (tests shorten it), for the coordinator's acknowledgements too.
METRICS_TTL = 300.0
METRICS_TTL_ENV = "DEDLOC_METRICS_TTL"


def metrics_ttl() -> float:
    """The metrics records' (and acknowledgements') lifetime in seconds: DEDLOC_METRICS_TTL, else METRICS_TTL."""
    value = os.environ.get(METRICS_TTL_ENV, "")
    try:
        return max(float(value), 1.0) if value else METRICS_TTL
    except ValueError:
        return METRICS_TTL
METRICS_INTERVAL = 5.0  # seconds between two stores of this peer's metrics record, at least (``MetricsPublisher``)
# Token and denylist records are republished every few seconds; they outlive a short outage.
TOKEN_RECORD_TTL = 60.0


class MetricsSchema(pydantic_v1.BaseModel):
    metrics: Dict[BytesWithPublicKey, Optional[MetricsRecord]]


class DenylistRecord(pydantic_v1.BaseModel):
    usernames: List[pydantic_v1.StrictStr]
    issued_at: pydantic_v1.StrictFloat
    signature: pydantic_v1.StrictStr


class AdmissionSchema(pydantic_v1.BaseModel):
    tokens: Dict[BytesWithPublicKey, Optional[bytes]]
    denylist: Dict[BytesWithPublicKey, Optional[DenylistRecord]]
    plan: Dict[BytesWithPublicKey, Optional[PlanRecord]]


def add_record_validators(dht: DHT, run_id: str, private_key=None) -> RSASignatureValidator:
    """Register signature and schema validators for this run's records; returns the signature validator."""
    signature = RSASignatureValidator(private_key)
    dht.add_validators(
        [
            signature,
            SchemaValidator(TrainingProgressSchema, prefix=run_id),
            SchemaValidator(MetricsSchema, prefix=run_id),
            SchemaValidator(AdmissionSchema, prefix=run_id),
        ]
    )
    return signature



def publish_metrics(dht: DHT, run_id: str, signature: RSASignatureValidator, record: MetricsRecord,
                    outbox=None) -> bool:
    """Store this peer's metrics record, signed with its key; True when the DHT accepted it. With a claim outbox
    (``credit.outbox.ClaimOutbox``) the record carries the oldest claims the coordinator has not acknowledged yet
    (all of them, or as many as fit a record) instead of the record's own."""
    if outbox is None:
        return store_metrics(dht, run_id, signature, record)
    with outbox.lock:  # one writer at a time: the newest record must be the one stored last
        return outbox.published(store_metrics(dht, run_id, signature, outbox.outgoing(record)))


class MetricsPublisher:
    """Publishes the training loop's metrics records from a thread, so that the loop goes on training while a record
    is stored (a store waits for the peers that hold the record: ~45 ms at each epoch in a two-worker swarm here).

    A record handed over while another waits replaces it: each record carries the recent epochs, and the claim
    outbox the oldest unacknowledged claims, so the newest holds all that the one it replaces did. So records are
    stored ``interval`` seconds apart at least: in a swarm of epochs seconds long, a record per epoch would cost a
    signed store and the coordinator's acknowledgement each, and tell nothing the next one does not.

    :param publish: stores one record (``publish_metrics`` with the run's DHT, id and signature)
    :param say: prints one line (a store that failed)
    """

    def __init__(self, publish: Callable[[MetricsRecord], object], say: Callable[[str], None] = print,
                 interval: float = METRICS_INTERVAL) -> None:
        self._publish, self._say, self._interval = publish, say, interval
        self._pending: Optional[MetricsRecord] = None
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="dedloc-metrics", daemon=True)
        self._thread.start()

    def submit(self, record: MetricsRecord) -> None:
        """Publish ``record`` soon; returns at once."""
        with self._changed:
            self._pending = record
            self._changed.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Publish the record still waiting, if any, then stop (waits up to ``timeout`` seconds)."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        last = float("-inf")
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending is not None or self._closed)
                while not self._closed and time.monotonic() < last + self._interval:  # closing flushes at once
                    self._changed.wait(last + self._interval - time.monotonic())
                record, self._pending = self._pending, None
            if record is None:
                return
            last = time.monotonic()
            try:
                self._publish(record)
            except DHT_FAILURES as e:  # the DHT shutting down, or unreachable: the next record carries the same claims
                self._say(f"could not publish this peer's metrics record ({type(e).__name__}: {e}); "
                          "the next epoch's record carries its claims")


def store_metrics(dht: DHT, run_id: str, signature: RSASignatureValidator, record: MetricsRecord) -> bool:
    return bool(
        dht.store(
            key=metrics_key(run_id),
            subkey=signature.local_public_key,
            value=record.dict(),
            expiration_time=get_dht_time() + metrics_ttl(),
            return_future=False,
        )
    )


@dataclass
class PeerProgress:
    peer_key: str  # contract.peer_key_of the signing public key
    progress: LocalTrainingProgress


@dataclass
class PeerMetrics:
    peer_key: str
    record: MetricsRecord


def _entries(dht: DHT, key: str) -> Dict[bytes, object]:
    found = dht.get(key, latest=True, return_future=False)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {subkey: entry.value for subkey, entry in found.value.items() if entry.value is not None}


def read_progress(dht: DHT, run_id: str, max_age: float) -> List[PeerProgress]:
    """Progress records of peers that reported within ``max_age`` seconds."""
    now = get_dht_time()
    peers = []
    for subkey, value in _entries(dht, progress_key(run_id)).items():
        try:
            progress = LocalTrainingProgress.parse_obj(value)
        except pydantic_v1.ValidationError:
            continue
        if now - progress.time <= max_age:
            peers.append(PeerProgress(peer_key_of_subkey(subkey), progress))
    return peers


def read_metrics(dht: DHT, run_id: str) -> List[PeerMetrics]:
    """Every live metrics record of the run, however old (crediting needs the late ones too)."""
    records = []
    for subkey, value in _entries(dht, metrics_key(run_id)).items():
        try:
            records.append(PeerMetrics(peer_key_of_subkey(subkey), MetricsRecord.parse_obj(value)))
        except pydantic_v1.ValidationError:
            continue
    return records



def publish_token(dht: DHT, run_id: str, signature: RSASignatureValidator, token: AccessToken) -> bool:
    """Publish this peer's token, so peers it never called through the DHT can admit it too."""
    return bool(dht.store(tokens_key(run_id), token.SerializeToString(), get_dht_time() + TOKEN_RECORD_TTL,
                          subkey=signature.local_public_key, return_future=False))


def read_tokens(dht: DHT, run_id: str) -> List[AccessToken]:
    tokens = []
    for value in _entries(dht, tokens_key(run_id)).values():
        try:
            tokens.append(AccessToken.FromString(value))
        except (DecodeError, TypeError):
            continue
    return tokens


def publish_denylist(dht: DHT, run_id: str, signature: RSASignatureValidator, denylist: dict) -> bool:
    return bool(dht.store(denylist_key(run_id), DenylistRecord(**denylist).dict(), get_dht_time() + TOKEN_RECORD_TTL,
                          subkey=signature.local_public_key, return_future=False))


def read_denylist(dht: DHT, run_id: str, check) -> List[str]:
    """Banned usernames from the newest denylist signed by the run's authority ([] when none)."""
    newest = newest_denylist(dht, run_id, check)
    return list(newest.usernames) if newest else []


def newest_denylist(dht: DHT, run_id: str, check) -> Optional[DenylistRecord]:
    """The newest denylist in the DHT signed by the run's authority, whoever stored it (None when none)."""
    return _newest_authentic(dht, denylist_key(run_id), DenylistRecord, check, _denylist_payload)


def authentic_denylist(values: dict, check) -> Optional[DenylistRecord]:
    """A denylist from elsewhere (the portal), if the run's authority signed it."""
    from dedloc_common.signing import verify

    record = DenylistRecord.parse_obj(values)
    return record if verify(check.authority, _denylist_payload(record), record.signature) else None


def _denylist_payload(record: DenylistRecord) -> bytes:
    return denylist_payload(record.usernames, record.issued_at)


def publish_plan(dht: DHT, run_id: str, signature: RSASignatureValidator, plan: PlanRecord) -> bool:
    """Store the run's averaging plan (already signed by the run's authority) under this coordinator's key."""
    return bool(dht.store(plan_key(run_id), plan.dict(), get_dht_time() + TOKEN_RECORD_TTL,
                          subkey=signature.local_public_key, return_future=False))


def read_plan(dht: DHT, run_id: str, check) -> Optional[PlanRecord]:
    """The newest plan signed by the run's authority, or None (two coordinators may both publish one). A ceiling
    the authority did not sign is dropped from it (``authentic_ceiling``)."""
    plan = _newest_authentic(dht, plan_key(run_id), PlanRecord, check,
                             lambda record: plan_payload(record.shares, record.predicted_seconds, record.issued_at,
                                                         record.groups))
    return None if plan is None else authentic_ceiling(plan, check)


def authentic_ceiling(plan: PlanRecord, check) -> PlanRecord:
    """``plan`` as is where its ceiling is the authority's (or absent); without the ceiling otherwise."""
    from dedloc_common.signing import verify

    if plan.ceiling is None or verify(check.authority, ceiling_payload(plan.ceiling, plan.issued_at),
                                      plan.ceiling_signature):
        return plan
    return plan.copy(update=dict(ceiling=None, ceiling_signature=""))


def publish_acks(dht: DHT, run_id: str, signature: RSASignatureValidator, acks: List[AckRecord],
                 timeout: float = 10.0) -> int:
    """Store the coordinator's acknowledgements (already signed by the run's authority), one DHT key per peer key,
    under this coordinator's subkey; returns how many the DHT accepted."""
    expiration = get_dht_time() + metrics_ttl()
    futures = [dht.store(ack_key(run_id, ack.peer_key), ack.dict(), expiration, subkey=signature.local_public_key,
                         return_future=True) for ack in acks]
    accepted = 0
    for future in futures:
        try:
            accepted += bool(future.result(timeout=timeout))
        except DHT_FAILURES:  # a slow or failed store: the next poll publishes it again
            continue
    return accepted


def read_ack(dht: DHT, run_id: str, peer_key: str, check) -> Optional[int]:
    """The newest epoch up to which the run's coordinators acknowledged this peer key's claims, or None. Only the
    authority's signature counts; the highest acknowledged epoch wins (acknowledgements only grow)."""
    from dedloc_common.signing import verify

    found = None
    for value in _entries(dht, ack_key(run_id, peer_key)).values():
        try:
            record = AckRecord.parse_obj(value)
        except pydantic_v1.ValidationError:
            continue
        if record.peer_key == peer_key and verify(check.authority, ack_payload(record.peer_key, record.epoch,
                                                                                record.issued_at), record.signature):
            found = record.epoch if found is None else max(found, record.epoch)
    return found


def _newest_authentic(dht: DHT, key: str, model, check, payload_of):
    """The record under ``key`` with the latest ``issued_at`` whose signature is the run's authority's, or None:
    any coordinator (or anyone) may publish under its own subkey, only the authority's signature counts."""
    from dedloc_common.signing import verify

    newest = None
    for value in _entries(dht, key).values():
        try:
            record = model.parse_obj(value)
        except pydantic_v1.ValidationError:
            continue
        if verify(check.authority, payload_of(record), record.signature):
            if newest is None or record.issued_at > newest.issued_at:
                newest = record
    return newest
