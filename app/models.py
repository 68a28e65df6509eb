"""Database models. The schema changes only through Alembic migrations (migrations/)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Optional

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from app.core.clock import utcnow

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


def max_length(model: type[Base], column: str) -> int:
    """How many characters a model's String column holds: text cut to it fits every database."""
    column_type = model.__table__.c[column].type
    if not isinstance(column_type, String) or column_type.length is None:
        raise TypeError(f"{model.__name__}.{column} is not a String of a given length")
    return column_type.length


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    slug: Mapped[str] = mapped_column(String(64), unique=True)
    title: Mapped[str] = mapped_column(String(200))
    task: Mapped[str] = mapped_column(String(200))
    task_options: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    target_batch_size: Mapped[int] = mapped_column(Integer)
    batch_size: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(Integer, default=0)
    optimizer: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Who may get peer tokens: "open" (any signed-in user), "allowlist", or "org" (members of admission_org).
    admission: Mapped[str] = mapped_column(String(20), default="open")
    admission_org: Mapped[Optional[str]] = mapped_column(String(100), nullable=True)
    # Plausibility: a claim above this many samples per second per peer is held, not credited. Where the organizer
    # did not set it (ceiling_from_organizer), the ceiling is derived from the swarm's confirmed rates and this is
    # the default before there are any (app.credit.ceiling).
    samples_per_second_ceiling: Mapped[float] = mapped_column(Float, default=5000.0)
    ceiling_from_organizer: Mapped[bool] = mapped_column(Boolean, default=False)
    # The run's token authority: RSA private key, encrypted with the portal's secret key (Fernet).
    authority_key_encrypted: Mapped[Optional[bytes]] = mapped_column(LargeBinary, nullable=True)
    # A run's life: "active", "paused" (workers wait) or "finished" (target reached, or ended by an organizer).
    state: Mapped[str] = mapped_column(String(20), default="active")
    target_epochs: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    # When the checkpointer saves and what it keeps (contract.CheckpointOptions), and where it pushes.
    checkpoints: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_by: Mapped[Optional[str]] = mapped_column(String(100), nullable=True)


class RunOrganizer(Base):
    """Who may organize a run besides the portal-wide organizers: its creator and whom they add."""

    __tablename__ = "run_organizers"
    __table_args__ = (UniqueConstraint("run_id", "username"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    username: Mapped[str] = mapped_column(String(100))


class Checkpoint(Base):
    """A saved state of the collaboration's model: the archive lives under DATA_DIR/runs/<slug>/checkpoints."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "epoch"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    epoch: Mapped[int] = mapped_column(Integer)
    samples: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    eval_loss: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger)
    file_name: Mapped[str] = mapped_column(String(200))
    final: Mapped[bool] = mapped_column(Boolean, default=False)


class Evaluation(Base):
    """One evaluation the checkpointer made: the held-out loss of the collaboration's state at an epoch. Kept for the
    run's life, whichever checkpoint archives pruning keeps (the dashboard's evaluation chart reads these)."""

    __tablename__ = "evaluations"
    __table_args__ = (UniqueConstraint("run_id", "epoch"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    epoch: Mapped[int] = mapped_column(Integer)
    samples: Mapped[int] = mapped_column(BigInteger)
    eval_loss: Mapped[float] = mapped_column(Float)
    evaluated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Coordinator(Base):
    """A coordinator process serving a run: the bootstrap peer workers are sent to."""

    __tablename__ = "coordinators"
    __table_args__ = (UniqueConstraint("run_id", "peer_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    peer_id: Mapped[str] = mapped_column(String(100))
    multiaddrs: Mapped[list[str]] = mapped_column(JSON)
    # Addresses of workers it saw lately: after a restart it bootstraps from them (the swarm forgot it).
    known_peers: Mapped[list[str]] = mapped_column(JSON, default=list)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    heartbeat_at: Mapped[Optional[datetime]] = mapped_column(DateTime(timezone=True), nullable=True)
    # Set when it stops cleanly (the last heartbeat stays, for the status page); cleared when it starts again.
    stopped_at: Mapped[Optional[datetime]] = mapped_column(DateTime(timezone=True), nullable=True)


class Snapshot(Base):
    """The swarm as the coordinator saw it at one poll. Crediting reads the coordinator's clock from these: when
    the swarm was seen before and after an epoch (``app.credit.windows.epoch_window``)."""

    __tablename__ = "snapshots"
    __table_args__ = (Index("ix_snapshots_run_id_epoch", "run_id", "epoch"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    taken_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    peers_online: Mapped[int] = mapped_column(Integer)
    samples_per_second: Mapped[float] = mapped_column(Float)
    epoch: Mapped[int] = mapped_column(Integer)
    loss: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    samples_total: Mapped[int] = mapped_column(BigInteger)
    samples_accumulated: Mapped[int] = mapped_column(BigInteger, default=0)
    eta_seconds: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    # Of peers_online: in client mode by their own choice, and found unreachable by the dial-back (client mode too).
    peers_client: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    peers_unreachable: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class Contribution(Base):
    """Samples one peer key claims it put into one collaboration step, and how much of that is credited.

    One row per (run, peer key, epoch), ever. ``samples`` is the claim; ``credited + held == samples``;
    ``reason`` says in words why anything is held.
    """

    __tablename__ = "contributions"
    __table_args__ = (UniqueConstraint("run_id", "peer_key", "epoch"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    peer_key: Mapped[str] = mapped_column(String(64))
    epoch: Mapped[int] = mapped_column(Integer)
    username: Mapped[str] = mapped_column(String(100), index=True)
    samples: Mapped[int] = mapped_column(BigInteger)
    loss_sum: Mapped[float] = mapped_column(Float)
    mini_steps: Mapped[int] = mapped_column(Integer)
    seconds: Mapped[float] = mapped_column(Float)
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    credited: Mapped[int] = mapped_column(BigInteger, default=0)
    held: Mapped[int] = mapped_column(BigInteger, default=0)
    reason: Mapped[Optional[str]] = mapped_column(String(300), nullable=True)
    # The all-reduce round (hivemind group id, hex) the samples went into: receipts are matched on it.
    group_id: Mapped[str] = mapped_column(String(64), default="", index=True)
    # An organizer who released held credit: the row then stays credited in full.
    released_by: Mapped[Optional[str]] = mapped_column(String(100), nullable=True)
    # The round's members (PeerIDs) as the claimant's signed record lists them: receipts count only from these.
    members: Mapped[list[str]] = mapped_column(JSON, default=list)
    # How long the epoch lasted at most as the coordinator's clock saw it (snapshots): the ceiling's time, and the
    # cap on the runtime credited. None until settled.
    observed_seconds: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    # Seconds of the epoch the peer spent computing, and payload bytes it sent in the epoch's round, as it reported
    # them (the progress API's per-peer figures); None where a worker did not say.
    compute_seconds: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    sent_bytes: Mapped[Optional[int]] = mapped_column(BigInteger, nullable=True)


class Receipt(Base):
    """An aggregator's signed word: in round ``group_id`` it averaged ``sender``'s part with this weight (samples)."""

    __tablename__ = "receipts"
    __table_args__ = (UniqueConstraint("run_id", "aggregator_key", "group_id", "sender_peer_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    aggregator_key: Mapped[str] = mapped_column(String(64))
    group_id: Mapped[str] = mapped_column(String(64), index=True)
    epoch: Mapped[int] = mapped_column(Integer)
    sender_peer_id: Mapped[str] = mapped_column(String(100))
    weight: Mapped[float] = mapped_column(Float)
    # What the aggregator cut from the sender's parts under robust aggregation (contract.Attestation as a dict);
    # None when it cut nothing or does not say.
    attestation: Mapped[Optional[dict]] = mapped_column(JSON, nullable=True)


class Dispute(Base):
    """A receipt that disagreed with a claim, recorded against its author (the aggregator's user).

    ``kind``: "outvoted" (the claimant and most other users in the round agree otherwise), "not a member" (its
    author was not in the round as the claimant's signed record lists it), "unresolved" (no majority: the claim is
    held as disputed and an organizer decides). Kept in step with the claim's settlement, once per (round, claim
    key, aggregator key).
    """

    __tablename__ = "disputes"
    __table_args__ = (UniqueConstraint("run_id", "group_id", "claim_key", "aggregator_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    group_id: Mapped[str] = mapped_column(String(64))
    epoch: Mapped[int] = mapped_column(Integer)
    claim_key: Mapped[str] = mapped_column(String(64))
    claimant: Mapped[str] = mapped_column(String(100))
    claimed: Mapped[int] = mapped_column(BigInteger)
    aggregator_key: Mapped[str] = mapped_column(String(64))
    author: Mapped[str] = mapped_column(String(100), index=True)
    seen: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(20))
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Peer(Base):
    """A peer key seen in a run: whose it is (from the token table), what hardware it reported, when."""

    __tablename__ = "peers"
    __table_args__ = (UniqueConstraint("run_id", "peer_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    peer_key: Mapped[str] = mapped_column(String(64))
    username: Mapped[str] = mapped_column(String(100), index=True)
    hardware: Mapped[str] = mapped_column(String(200), default="")
    # What the peer's metrics record says of it: contract.REACHABILITY ("" when not reported).
    reachability: Mapped[str] = mapped_column(String(20), default="", server_default="")
    # What the run needs in memory on its device, as its metrics record says (contract.MemoryReport); None: not said.
    memory: Mapped[Optional[dict]] = mapped_column(JSON, nullable=True)
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class IssuedPeerToken(Base):
    """Every peer token ever issued: what turns the peer key of a DHT record into a user's credit."""

    __tablename__ = "peer_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    username: Mapped[str] = mapped_column(String(100), index=True)
    peer_public_key: Mapped[str] = mapped_column(Text)
    peer_id: Mapped[str] = mapped_column(String(100), index=True)
    # The peer key its DHT records are found under (contract.peer_key_of): links records to a user.
    peer_key: Mapped[str] = mapped_column(String(64), index=True, default="")
    issued_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class RunBan(Base):
    __tablename__ = "run_bans"
    __table_args__ = (UniqueConstraint("run_id", "username"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    username: Mapped[str] = mapped_column(String(100))
    reason: Mapped[str] = mapped_column(String(500), default="")
    banned_by: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class RunAllowlistEntry(Base):
    __tablename__ = "run_allowlist"
    __table_args__ = (UniqueConstraint("run_id", "username"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    username: Mapped[str] = mapped_column(String(100))


class AveragingPlan(Base):
    """A plan the coordinator published: who aggregates which share of the gradient vector, and how it went."""

    __tablename__ = "averaging_plans"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    # One entry per peer of the plan: {"peer_id", "peer_key", "username", "share", "role" ("aggregator", "client"
    # or "aux"), "upload_bps", "download_bps"}; bandwidths in bytes per second, as the workers measured them.
    # Plans stored before entries carried "peer_key" lack it (plans.plan_fingerprint falls back to the PeerID).
    peers: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    vector_bytes: Mapped[int] = mapped_column(BigInteger)
    predicted_seconds: Mapped[float] = mapped_column(Float)
    lower_bound_seconds: Mapped[float] = mapped_column(Float)
    # Median of the round times the peers reported while this plan was current; None until one is reported.
    measured_seconds: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    reason: Mapped[str] = mapped_column(String(200), default="")
    # The round model fitted from the peers' measured rounds (app.planner.fit), refreshed each poll while the plan
    # is current: its costs beyond bandwidth, how many rounds it rests on, and what it predicts for this plan now.
    # None until three rounds were measured (plans stored before the fit have none).
    latency_seconds: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    part_seconds: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    fitted_rounds: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    fitted_seconds: Mapped[Optional[float]] = mapped_column(Float, nullable=True)


class SpotCheck(Base):
    """The checkpointer recomputed one claim's gradient on the peer's own data (app/coordinator/spot_checker.py)
    and compared it with the sketch the peer published: the figures, the verdict, and the evidence in words; or a
    drawn claim it could not judge (``skipped`` says why). A failed check, or a drawn claim without a usable sketch,
    holds every claim of that peer's account in the run until an organizer lifts it (app/credit/spot_checks.py)."""

    __tablename__ = "spot_checks"
    __table_args__ = (UniqueConstraint("run_id", "peer_key", "epoch"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    peer_key: Mapped[str] = mapped_column(String(64))
    username: Mapped[str] = mapped_column(String(100))
    epoch: Mapped[int] = mapped_column(Integer)
    mini_steps: Mapped[int] = mapped_column(Integer)
    passed: Mapped[bool] = mapped_column(Boolean)
    # cosine similarity of the published and recomputed sketches; their norms' ratio (published / recomputed)
    cosine: Mapped[float] = mapped_column(Float)
    norm_ratio: Mapped[float] = mapped_column(Float)
    claimed_loss: Mapped[float] = mapped_column(Float)
    recomputed_loss: Mapped[float] = mapped_column(Float)
    evidence: Mapped[str] = mapped_column(String(300))
    checked_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Why a drawn claim was not judged ("" when it was): "no sketch", "partial" (samples that are not whole
    # mini-batches), "no claim" (none came: the peer left or skipped the epoch), "nothing claimed" (0 samples).
    skipped: Mapped[str] = mapped_column(String(20), default="", server_default="")
    # The organizer who lifted the hold this check put on the account.
    lifted_by: Mapped[Optional[str]] = mapped_column(String(100), nullable=True)
