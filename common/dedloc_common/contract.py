"""The wire contract between the portal, the coordinator and the workers.

Everything that crosses a process boundary is defined here, once: the run configuration the portal serves, the
join answer, and the metrics record workers publish in the DHT. The portal imports this module; it must therefore
never import torch or hivemind.

The DHT record models use ``pydantic.v1`` because hivemind's ``SchemaValidator`` validates with pydantic v1;
the HTTP models use pydantic v2 like the rest of the portal.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING, Annotated, Any, Dict, List, Literal, Optional

import pydantic.v1 as pydantic_v1
from pydantic import AfterValidator, BaseModel, Field, PlainSerializer, model_validator

API_PREFIX = "/api/v1"
# How many past epochs the training loop hands to each metrics record. The worker's claim outbox
# (dedloc_worker.credit.outbox) keeps more: every claim the coordinator has not acknowledged (two hours' worth at 1 s
# per epoch), and the record carries the oldest of them, up to the caps below.
RECENT_EPOCHS_KEPT = 32
# At most this many unacknowledged claims, and this many bytes of them (JSON), ride in one metrics record: every
# peer's record lives under one DHT key and the coordinator reads them all in one reply (hivemind's limit is 2 MiB).
PENDING_CLAIMS_KEPT = 256
PENDING_CLAIMS_BYTES = 48 * 1024
# hivemind's part_size_bytes for gradient averaging (its default is 512 KiB): the unit in which the vector is split
# between aggregators and streamed, so the coordinator plans with it. Smaller parts let results trail uploads by
# less (docs/benchmarks.md#part-size).
GRADIENT_PART_BYTES = 2**17


def in_utc(moment: datetime) -> datetime:
    """``moment`` in UTC; a naive one (SQLite hands those back) is taken as UTC already."""
    if moment.tzinfo is None:
        return moment.replace(tzinfo=timezone.utc)
    try:
        return moment.astimezone(timezone.utc)
    except OverflowError:  # 0001-01-01 at +01:00 is before the first UTC moment Python holds
        raise ValueError("out of range once in UTC") from None


# Every moment the HTTP API sends: timezone-aware UTC, written as RFC 3339 with its offset ("...Z"). A naive value
# read from an older portal is taken as UTC, so models using it still parse what they parsed before.
UtcDateTime = Annotated[datetime, AfterValidator(in_utc), PlainSerializer(in_utc, return_type=datetime)]


def progress_key(run_id: str) -> str:
    """DHT key of hivemind's per-peer training progress records (written by ``hivemind.Optimizer``)."""
    return f"{run_id}_progress"


def peer_key_of_subkey(subkey: bytes) -> str:
    """The peer key, the name the database gives a peer: hex SHA-256 of its DHT record subkey "[owner:<key>]"."""
    import hashlib

    return hashlib.sha256(subkey).hexdigest()


def peer_key_of(public_key: bytes) -> str:
    """The same peer key from the public key itself (hivemind's RSASignatureValidator subkey format), so records
    and issued tokens meet on one string."""
    return peer_key_of_subkey(b"[owner:" + public_key + b"]")


def metrics_key(run_id: str) -> str:
    """DHT key of dedloc's per-peer metrics records (written by the worker, signed by its key)."""
    return f"{run_id}_metrics"


STATE_EVERY = 10  # OptimizerOptions.average_state_every by default; hivemind's is 1 (docs/hivemind.md#pitfalls, 12)
# A local-updates run's outer batch by default, in target batch sizes (docs/training-algorithms.md).
OUTER_BATCH_MULTIPLE = 64


class OptimizerOptions(BaseModel):
    """How the swarm optimizes and averages. Times are seconds. The defaults suit peers across the internet (after
    hivemind's examples); loopback swarms (the demo, the tests) set shorter times themselves."""

    name: Literal["adam", "adamw", "adamw-8bit", "lamb"] = Field(
        "adamw", description="lamb: pytorch_optimizer's LAMB; adamw-8bit: bitsandbytes' AdamW with 8-bit moments")
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    # The learning rate rises linearly over warmup_epochs, then falls linearly to 0 over decay_epochs (if given).
    warmup_epochs: int = Field(0, ge=0)
    decay_epochs: Optional[int] = Field(None, gt=0)
    clip_grad_norm: Optional[float] = Field(None, gt=0, description="clip each peer's gradient norm to this")
    # What averaged gradients travel as: hivemind's fp16 (the default, as in hivemind's ALBERT example: half the
    # bytes of float32 on every volunteer's link) or 8-bit quantization, or uncompressed float32.
    compression: Literal["none", "fp16", "uint8"] = "fp16"
    matchmaking_time: float = Field(5.0, gt=0)
    averaging_timeout: float = Field(60.0, gt=0)
    # A sender (an aggregator) silent this long (twice this) between two parts of a round is dropped from it; None:
    # hivemind's default, matchmaking_time. Peers that share few cores with many processes stall for longer.
    next_chunk_timeout: Optional[float] = Field(None, gt=0)
    # Progress records of dead peers linger this long (seconds); short keeps survivors at full speed.
    metadata_expiration: float = Field(60.0, gt=0)
    # Delayed parameter updates (DPU, the paper's): a step's round and update run during the next accumulation, so a
    # worker computes while its round runs (docs/benchmarks.md#delayed-parameter-updates).
    delay_optimizer_step: bool = True
    delay_grad_averaging: bool = True
    # How each aggregator averages its parts: centered_clip caps each sender's weight at the run's ceiling for the
    # round, drops non-finite parts and runs CenteredClip (docs/averaging.md#robust-aggregation); mean: hivemind's
    # plain weighted mean. clip_radius is tau for the whole gradient vector (its L2 norm units).
    aggregation: Literal["centered_clip", "mean"] = "centered_clip"
    clip_radius: float = Field(1.0, gt=0, allow_inf_nan=False)
    clip_iterations: int = Field(20, ge=1, le=1000)
    # At most this many peers average together (hivemind's target_group_size); a larger swarm averages in groups,
    # so that a peer that fails mid-round fails its group only (docs/averaging.md#groups). 8 as in sahajBERT; at
    # least 3, since groups of at most 2 leave one peer of an odd swarm alone, averaging with nobody.
    group_size: int = Field(8, ge=3, le=1024)
    # Peers that averaged a step's gradients take the same step, so their parameters agree without averaging them;
    # averaging the parameters too (hivemind's state averaging: a second matchmaking and all-reduce of the whole
    # model) is there to pull back a peer that stepped alone. Every this many steps.
    average_state_every: int = Field(STATE_EVERY, ge=1)
    # The training algorithm (docs/training-algorithms.md). large-batch: every optimizer step averages the whole
    # gradient of target_batch_size samples. local-updates (DiLoCo): each peer takes its own optimizer steps (the
    # options above are the inner optimizer's) and the swarm averages pseudo-gradients (outer minus local
    # parameters, weighted by samples) once it has trained outer_batch_size samples since the last outer round, then
    # takes an outer Nesterov step (outer_lr, outer_momentum; DiLoCo's defaults) from the shared outer parameters.
    algorithm: Literal["large-batch", "local-updates"] = "large-batch"
    outer_batch_size: Optional[int] = Field(None, gt=0, description="local-updates: samples the swarm trains "
                                            f"between outer rounds; none: {OUTER_BATCH_MULTIPLE} times the run's "
                                            "target batch size")
    outer_lr: float = Field(0.7, gt=0, allow_inf_nan=False)
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    # local-updates: each outer round runs while the next inner steps train, and is applied when it ends (while a
    # round takes at most a quarter of a phase; docs/training-algorithms.md#overlap), so the GPU does not wait for
    # the network. False: each peer waits for its round.
    overlap_outer_rounds: bool = True

    @model_validator(mode="before")
    @classmethod
    def _one_option_sets_both(cls, values: Any) -> Any:
        """Either option alone turns delayed updates on or off: averaging in the background needs delayed updates."""
        if isinstance(values, dict) and len({"delay_optimizer_step", "delay_grad_averaging"} & values.keys()) == 1:
            given = values.get("delay_optimizer_step", values.get("delay_grad_averaging"))
            values = {"delay_optimizer_step": given, "delay_grad_averaging": given, **values}
        return values

    @model_validator(mode="after")
    def _averaging_in_background_needs_delayed_updates(self) -> "OptimizerOptions":
        if self.delay_grad_averaging and not self.delay_optimizer_step:
            raise ValueError("delay_grad_averaging needs delay_optimizer_step (averaging in the background delays "
                             "the update): set both to false to turn delayed updates off")
        return self


def outer_batch_of(options: OptimizerOptions, target_batch_size: int) -> int:
    """Samples between two outer rounds of a local-updates run (its hivemind target batch size)."""
    return options.outer_batch_size or OUTER_BATCH_MULTIPLE * target_batch_size


# Loopback swarms (the demo, the tests): every peer on one machine, rounds form in well under a second.
LOOPBACK_OPTIMIZER = {"matchmaking_time": 0.5, "averaging_timeout": 5.0, "metadata_expiration": 15.0}
RUN_STATES = ("active", "paused", "finished")


class CheckpointOptions(BaseModel):
    """When the checkpointer (in the coordinator's process) saves the collaboration's state, and what it keeps."""

    every_epochs: int = Field(10, ge=1, description="save after this many optimizer steps")
    every_minutes: Optional[float] = Field(None, gt=0, description="and at least this often, when given")
    keep: int = Field(3, ge=1, description="how many checkpoints stay downloadable (the final one always does)")
    hub_repo: Optional[str] = Field(None, description="push each checkpoint to this Hugging Face Hub model "
                                                      "repository (the coordinator's HF_TOKEN)")
    spot_check_rate: float = Field(0.02, ge=0, le=1, description="the share of claims whose gradient the "
                                   "checkpointer recomputes on the peer's own data (docs/spot-checks.md); 0: none")


class RunConfig(BaseModel):
    """A run as workers see it: what to train, how to average, and whether to train now."""

    slug: str
    run_id: str = Field(description="hivemind run id: prefix of every DHT key of this run")
    task: str = Field(description="a built-in task (dedloc_common.tasks) or 'module:attr' of a Task class")
    task_options: Dict[str, Any] = Field(default_factory=dict)
    target_batch_size: int = Field(gt=0, description="samples per collaboration-wide optimizer step")
    batch_size: int = Field(gt=0, description="samples per local mini-step")
    seed: int = 0
    optimizer: OptimizerOptions = Field(default_factory=OptimizerOptions)
    target_epochs: Optional[int] = Field(None, gt=0, description="the run ends after this many optimizer steps")
    state: Literal["active", "paused", "finished"] = "active"
    samples_per_second_ceiling: Optional[float] = Field(None, gt=0, description="plausible samples per second per "
                                                        "peer: aggregators cap senders' weights with it")


class RunFile(BaseModel):
    """A file a run serves to its workers (``GET /api/v1/runs/{slug}/files``): data, or a trained tokenizer."""

    name: str
    size: int = Field(ge=0, description="bytes")
    sha256: str


class CheckpointInfo(BaseModel):
    """A stored checkpoint of a run (``GET /api/v1/runs/{slug}/checkpoints``, newest first)."""

    epoch: int = Field(ge=0)
    samples: int = Field(ge=0, description="samples the collaboration had averaged when it was taken")
    created_at: UtcDateTime
    eval_loss: Optional[float] = Field(None, description="loss on the run's held-out data, None without any")
    sha256: str = Field(description="of the archive")
    size: int = Field(ge=0, description="bytes of the archive")
    url: str = Field(description="a tar archive whose files load with from_pretrained after extraction")
    final: bool = Field(False, description="saved when the run reached its target: the trained model")


class JoinInfo(BaseModel):
    """What ``GET /api/v1/runs/{slug}/join`` returns to a worker."""

    config: RunConfig
    initial_peers: List[str] = Field(description="multiaddrs of the run's coordinator(s); empty while none is up")
    checkpoint: Optional[CheckpointInfo] = Field(None, description="the newest checkpoint: where a swarm that "
                                                 "lost every peer resumes")
    notice: Optional[str] = Field(None, description="in words, why a worker cannot join now (no coordinator is up, "
                                  "since when); None when it can")


# The constrained types of the DHT records. pydantic v1 builds them with function calls, which mypy cannot read as
# annotations; it sees their plain base types instead (as pydantic.v1.types does for its own StrictInt and the like).
if TYPE_CHECKING:
    StrictNonNegativeInt = int
    StrictNonNegativeFloat = float
    NonNegativeFloat = float
    UnitFloat = float
    PositiveFiniteFloat = float
    ShortStr = str
    GroupBits = str
else:
    StrictNonNegativeInt = pydantic_v1.conint(ge=0, strict=True)
    StrictNonNegativeFloat = pydantic_v1.confloat(ge=0.0, strict=True)
    NonNegativeFloat = pydantic_v1.confloat(ge=0.0)
    UnitFloat = pydantic_v1.confloat(ge=0.0, le=1.0)
    PositiveFiniteFloat = pydantic_v1.confloat(gt=0.0, lt=float("inf"))
    ShortStr = pydantic_v1.constr(max_length=200)
    GroupBits = pydantic_v1.constr(regex=r"^[01]{1,16}$")  # the bits of hivemind's group key


class EpochContribution(pydantic_v1.BaseModel):
    """Samples one peer accumulated into one collaboration step (epoch)."""

    epoch: StrictNonNegativeInt
    samples: StrictNonNegativeInt
    loss_sum: pydantic_v1.StrictFloat
    mini_steps: StrictNonNegativeInt
    seconds: StrictNonNegativeFloat
    # The all-reduce round (hivemind group id, hex) this peer's samples went into; "" when unknown.
    group: pydantic_v1.StrictStr = ""
    # Receipts: group -> PeerID -> the weight (samples) every sender's gradient parts carried into the average this
    # peer aggregated: after the run's cap, times the share of its parts that came and were finite, 0 when they were
    # all zeros (dedloc_worker.averaging.robust.Attestation.applied). Workers before that field: the weight of its first
    # part.
    aggregated: Dict[pydantic_v1.StrictStr, Dict[pydantic_v1.StrictStr, float]] = {}
    # The PeerIDs of every member of ``group`` as hivemind formed it (this peer included); [] when unknown (a
    # worker before this field). The coordinator counts a receipt for this claim only from a listed member.
    members: List[pydantic_v1.StrictStr] = []
    # A sketch of the gradient this peer accumulated in the epoch, for spot checks (dedloc_worker.training.spot_checks),
    # as encode_sketch writes it; "" when its task cannot be checked (or a worker before this field).
    sketch: pydantic_v1.StrictStr = ""
    # Attestations: group -> PeerID -> what this peer, as an aggregator, cut from that sender or missed of its parts
    # (only senders whose receipt is less than their weight, or cut at all): see Attestation.
    attested: Dict[pydantic_v1.StrictStr, Dict[pydantic_v1.StrictStr, "Attestation"]] = {}
    # Seconds of the epoch spent computing (forward and backward passes) and payload bytes this peer sent in the
    # epoch's round (dedloc_worker.averaging.planned.Transfers); None where unknown (a worker before these fields, a
    # round that did not form here).
    compute_seconds: Optional[StrictNonNegativeFloat] = None
    sent_bytes: Optional[StrictNonNegativeInt] = None


class Attestation(pydantic_v1.BaseModel):
    """How an aggregator treated one sender's parts in one round (dedloc_worker.averaging.robust). The fields after
    ``kept`` came later: a record without them reads as 0 (not said)."""

    parts: StrictNonNegativeInt  # parts of the sender it aggregated
    weight: NonNegativeFloat  # the weight (samples) the sender sent; 0 when it was not finite
    used: NonNegativeFloat  # the weight after the ceiling's cap
    dropped: StrictNonNegativeInt  # parts dropped as not finite
    clipped: StrictNonNegativeInt  # parts whose offset from the centre CenteredClip cut
    kept: UnitFloat  # the smallest fraction of a clipped part's offset kept
    expected: StrictNonNegativeInt = 0  # parts the sender was to send it (its share of the vector)
    nonfinite: StrictNonNegativeInt = 0  # parts holding a NaN or an infinity (dropped or not)
    zeros: StrictNonNegativeInt = 0  # finite parts that were all zeros
    # Why the sender was left out of the round, its parts refused (dedloc_worker.averaging.announcements: a share its
    # signed plan does not give it); None when it was not
    left_out: Optional[ShortStr] = None

    def dict(self, **kwargs) -> dict:
        # without left_out where None: hivemind's SchemaValidator refuses a record that parsing changes, and the
        # attestations of robust aggregation (and of workers before this field) never carry it
        data = super().dict(**kwargs)
        if data.get("left_out") is None:
            data.pop("left_out", None)
        return data


EpochContribution.update_forward_refs(Attestation=Attestation)


class LinkReport(pydantic_v1.BaseModel):
    """How a peer takes part in averaging, as it measured itself; the planner's input.

    Bandwidths are bytes per second, measured by the worker with timed transfers to the portal (never typed in), at
    join and again every few minutes (``measured_at``). The ``round_*`` fields say what its last complete all-reduce
    achieved with its peers; the coordinator plans with whichever of the two figures is newer
    (``app.coordinator.planning.link_figures``). Fields are only ever added: older workers send their defaults.
    """

    upload_bps: StrictNonNegativeFloat = 0.0
    download_bps: StrictNonNegativeFloat = 0.0
    client_mode: pydantic_v1.StrictBool = False  # accepts no incoming connections: never aggregates
    aux: pydantic_v1.StrictBool = False  # auxiliary peer: aggregates, trains nothing
    vector_bytes: StrictNonNegativeInt = 0  # size of the averaged gradient vector
    # This peer's last all-reduce (after matchmaking), seconds; 0 before the first. planned: the round used a plan.
    round_seconds: StrictNonNegativeFloat = 0.0
    round_planned: pydantic_v1.StrictBool = False
    # When the portal measurement above was taken (unix seconds); 0: not said (a worker before this field).
    measured_at: StrictNonNegativeFloat = 0.0
    # What that last round moved over this peer's links: payload bytes of the tensor parts it sent and received
    # (its own share never leaves it; dedloc_worker.averaging.planned.Transfers), and when it ended (unix seconds); 0
    # before the first complete round.
    round_sent_bytes: StrictNonNegativeInt = 0
    round_received_bytes: StrictNonNegativeInt = 0
    round_ended: StrictNonNegativeFloat = 0.0


class MemoryReport(pydantic_v1.BaseModel):
    """What a run needs in memory on the device a worker trains on, as the worker measured it before joining
    (``dedloc_worker.training.memory``); the join page shows the newest per kind of device."""

    device: pydantic_v1.StrictStr  # "cuda" or "cpu"
    precision: pydantic_v1.StrictStr = "float32"  # the autocast dtype it trains in
    model_bytes: StrictNonNegativeInt  # parameters, gradients and optimizer state held on the device
    host_bytes: StrictNonNegativeInt = 0  # RAM besides: the offloaded optimizer's state
    fixed_bytes: StrictNonNegativeInt = 0  # a mini-step's activations whatever its size ...
    per_sample_bytes: StrictNonNegativeInt = 0  # ... and more for each sample in it
    peak_bytes: StrictNonNegativeInt = 0  # the device's peak at the micro-batch this worker trains at
    micro_batch: StrictNonNegativeInt = 0


class MetricsRecord(pydantic_v1.BaseModel):
    """A worker's signed metrics record; the DHT subkey is the worker's public key."""

    username: pydantic_v1.StrictStr
    epoch: StrictNonNegativeInt
    samples_per_second: StrictNonNegativeFloat
    time: pydantic_v1.StrictFloat
    recent: List[EpochContribution]
    # Where this peer accepts connections (empty for client-mode peers): a restarted coordinator bootstraps
    # from these. Never shown on public pages.
    addrs: List[pydantic_v1.StrictStr] = []
    # What the peer trains on, in words ("cuda: NVIDIA A100", "cpu: 8 threads"): shown to its owner only.
    hardware: pydantic_v1.StrictStr = ""
    link: Optional[LinkReport] = None
    # How the peer's mode was decided (one of REACHABILITY), "" when not reported.
    reachability: pydantic_v1.StrictStr = ""
    memory: Optional[MemoryReport] = None  # None: an auxiliary peer, or a worker before this field


# A worker's own account of its reachability: the coordinator's dial-back reached it (a full peer), or did not
# (it trains in client mode by itself), or it was told --client.
REACHABILITY = ("reachable", "unreachable", "client")


def encode_sketch(values: List[float]) -> str:
    """A gradient sketch in a claim: its L2 norm (float64), then its direction (float16 each), base64: about 190
    characters for 64 numbers, so unacknowledged claims stay small in the record."""
    import base64
    import math
    import struct

    norm = math.sqrt(sum(v * v for v in values))
    direction = [v / norm if norm > 0 else 0.0 for v in values]
    return base64.b64encode(struct.pack(f"<d{len(values)}e", norm, *direction)).decode()


def decode_sketch(text: str) -> List[float]:
    """The sketch ``encode_sketch`` wrote (direction times norm); ``ValueError`` when it is not one."""
    import base64
    import binascii
    import struct

    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as e:
        raise ValueError(f"not base64: {e}") from None
    if len(raw) < 8 or (len(raw) - 8) % 2:
        raise ValueError("not a sketch: wrong length")
    norm, *direction = struct.unpack(f"<d{(len(raw) - 8) // 2}e", raw)
    return [norm * v for v in direction]


def mean_loss(contributions: List[EpochContribution]) -> Optional[float]:
    """Mean loss per mini-step over contributions, or None when there are no mini-steps."""
    steps = sum(c.mini_steps for c in contributions)
    return sum(c.loss_sum for c in contributions) / steps if steps else None


# --- Averaging plans ---------------------------------------------------------------------------------------------
# The coordinator's planner publishes who aggregates which share of the gradient vector. The plan is signed by the
# run's authority (like the denylist), so a worker trusts it without knowing which key is the coordinator's.


def plan_key(run_id: str) -> str:
    """DHT key of the run's averaging plan (subkey: the publishing coordinator's public key)."""
    return f"{run_id}_plan"


class PlanRecord(pydantic_v1.BaseModel):
    """An averaging plan as published in the DHT. Shares are fractions of the vector by base58 PeerID."""

    shares: Dict[pydantic_v1.StrictStr, NonNegativeFloat]
    predicted_seconds: NonNegativeFloat
    issued_at: pydantic_v1.StrictFloat
    signature: pydantic_v1.StrictStr
    # Each peer's averaging group, as the bits of hivemind's group key (docs/averaging.md#groups); {}: one group.
    groups: Dict[pydantic_v1.StrictStr, GroupBits] = {}
    # The run's samples-per-second ceiling in force (the organizer's, or derived from the swarm's confirmed rates):
    # aggregators cap senders' weights with it (docs/averaging.md#ceiling). Signed on its own (``ceiling_payload``),
    # so that the plan's own signature, and readers of plans from before the ceiling rode along, stay as they were.
    ceiling: Optional[PositiveFiniteFloat] = None
    ceiling_signature: pydantic_v1.StrictStr = ""


def ceiling_payload(ceiling: float, issued_at: float) -> bytes:
    """The bytes the authority signs for a plan's ceiling (samples/s), bound to the plan by its ``issued_at``."""
    return f"ceiling {float(ceiling)!r} {float(issued_at)!r}".encode()


def plan_payload(shares: Dict[str, float], predicted_seconds: float, issued_at: float,
                 groups: Optional[Dict[str, str]] = None) -> bytes:
    """The bytes the authority signs: shares rounded to 1e-9 so every side serializes them alike. Groups are signed
    where the plan has them (a plan without them signs the same bytes as before they existed)."""
    import json

    body = {"shares": {peer: round(float(share), 9) for peer, share in sorted(shares.items())},
            "predicted_seconds": round(float(predicted_seconds), 6), "issued_at": repr(float(issued_at))}
    if groups:
        body["groups"] = dict(sorted(groups.items()))
    return b"plan " + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# --- Acknowledgements ------------------------------------------------------------------------------------------
# The coordinator acknowledges, per peer key, the newest epoch whose claim (and the receipts riding with it) the
# database holds: a record under ack_key(run_id, peer_key), subkey the coordinator's public key, signed by the run's
# authority. Until an acknowledgement covers a claim, its worker keeps the claim in its metrics record and keeps
# the record alive, so a coordinator that was down for longer than a record lives loses nothing.


def ack_key(run_id: str, peer_key: str) -> str:
    """DHT key of the coordinator's acknowledgement for one peer key (contract.peer_key_of)."""
    return f"{run_id}_ack_{peer_key}"


class AckRecord(pydantic_v1.BaseModel):
    """Every claim of ``peer_key`` up to ``epoch`` is in the coordinator's database."""

    peer_key: pydantic_v1.StrictStr
    epoch: StrictNonNegativeInt
    issued_at: pydantic_v1.StrictFloat
    signature: pydantic_v1.StrictStr


def ack_payload(peer_key: str, epoch: int, issued_at: float) -> bytes:
    """The bytes the authority signs for an acknowledgement."""
    return f"ack {peer_key} {int(epoch)} {float(issued_at)!r}".encode()


# --- Link probes -----------------------------------------------------------------------------------------------
# A worker measures its bandwidth with timed transfers to the portal: GET .../link-probe?size=N answers N bytes,
# POST .../link-probe reads and discards the body. Both need the worker's credential.
LINK_PROBE_MAX_BYTES = 16 * 1024 * 1024


# --- Peer tokens ---------------------------------------------------------------------------------------------
# A peer token is hivemind's AccessToken{username, public_key, expiration_time, signature}: the run's authority
# signs "username public_key expiration_time" with RSA-PSS/SHA-256 (hivemind's own signature scheme), the
# signature base64-encoded. public_key is the peer's RSA key in OpenSSH format (what hivemind expects);
# expiration_time is naive UTC in ISO 8601 (seconds).


def tokens_key(run_id: str) -> str:
    """DHT key where every peer publishes its current token (subkey: its public key)."""
    return f"{run_id}_tokens"


def denylist_key(run_id: str) -> str:
    """DHT key of the run's signed denylist, published by the coordinator."""
    return f"{run_id}_denylist"


def token_payload(username: str, public_key: bytes, expiration_time: str) -> bytes:
    return b" ".join([username.encode(), public_key, expiration_time.encode()])


def denylist_payload(usernames: List[str], issued_at: float) -> bytes:
    return ("denylist " + repr(float(issued_at)) + " " + ",".join(sorted(usernames))).encode()


class PeerTokenRequest(BaseModel):
    # The pattern documents the shape (OpenAPI); the portal checks the key itself (an RSA key of 2048 bits or more).
    public_key: str = Field(description="the worker's RSA public key, OpenSSH format", max_length=2000,
                            json_schema_extra={"pattern": r"^ssh-rsa AAAA[0-9A-Za-z+/]+={0,3}( [^\r\n]*)?$"})


class PeerToken(BaseModel):
    username: str
    public_key: str = Field(description="OpenSSH format")
    expiration_time: str = Field(description="naive UTC, ISO 8601")
    signature: str = Field(description="base64 RSA-PSS signature by the run's authority")


class PeerTokenGrant(BaseModel):
    """What ``POST /api/v1/runs/{slug}/peer-tokens`` returns."""

    token: PeerToken
    authority_public_key: str = Field(description="the run's authority key, OpenSSH format")
    lifetime_seconds: float
    join: JoinInfo


class ReachabilityRequest(BaseModel):
    """``POST /api/v1/runs/{slug}/reachability``: the multiaddrs a worker's swarm node listens on."""

    addrs: List[str] = Field(min_length=1, max_length=16)


class AddressCheck(BaseModel):
    addr: str = Field(description="the announced multiaddr")
    dialed: Optional[str] = Field(description="host:port the portal dialed; None when it dialed nothing for it")
    reachable: bool
    reason: str = Field(description="in words: what answered, or why nothing did")


class ReachabilityReport(BaseModel):
    """Whether peers can open connections to a worker: the portal dials it back, at the address the worker's
    request came from (only there: it dials no one else), on each port the worker announces."""

    reachable: bool = Field(description="some address answered as a libp2p peer: the worker can be a full peer")
    seen_from: str = Field(description="the address the portal sees the worker's request come from")
    checks: List[AddressCheck]
    how: str = Field(description="how this was decided, in words, for the worker's terminal and pages")


class SignedDenylist(BaseModel):
    """``GET /api/v1/runs/{slug}/denylist``: the run's bans signed by its authority (``denylist_payload``), as the
    coordinator publishes them to the DHT; workers ask the portal too, so a ban reaches them while no coordinator
    is up."""

    usernames: List[str]
    issued_at: float = Field(description="seconds since the epoch; the newest denylist a peer has seen wins")
    signature: str
