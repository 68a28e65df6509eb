"""The coordinator's side of adaptive averaging: from the peers' link reports to a signed plan in the DHT.

Each poll, the peers online with a measured link become ``PeerProfile``s (bandwidths: ``link_figures``, the portal
measurement or what the peer's last round achieved, whichever is newer); the ``Replanner`` decides whether a new
plan replaces the current one (hysteresis); a new plan is signed by the run's authority, written to the database
(the dashboard's view) and published in the DHT, where workers read it after each epoch and apply it to their
gradient averager. The current plan is republished every poll (DHT records expire), and the round times the
peers report under it are kept beside it as the measured figure.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from dedloc_common.contract import GRADIENT_PART_BYTES, LinkReport, PlanRecord, RunConfig, plan_payload
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.authority import tokens
from app.core.config import Settings
from app.models import AveragingPlan, Run
from app.planner import PeerProfile, Plan, PlanningError, Replanner, StepOptions

logger = logging.getLogger("dedloc.coordinator")
# Share of the vector the live plan spreads evenly over the senders, at most. hivemind hands out whole parts, so a
# peer given a sliver aggregates nothing and cannot attest the others: each sender gets ATTESTATION_PARTS parts'
# worth, or its even slice of ATTESTATION_SHARE on a small vector (docs/averaging.md#attestation-floor).
ATTESTATION_SHARE = 0.5
ATTESTATION_PARTS = 2
# Bytes per second of parts a CPU peer aggregates, on the cores it trains on: four peers on 2 cores are CPU-bound
# near 240 Mbit/s each way (docs/benchmarks.md#staying-within-the-cpu), 60 MB/s per core (docs/averaging.md#step).
CPU_REDUCE_BPS = 60e6
# A round's figures older than this say little about the link now (the worker re-measures its portal link every
# 10 minutes: dedloc_worker.planning.LINK_REMEASURE).
ROUND_FRESH_S = 600.0
# Below this many bytes each way a round's time is mostly latency and matchmaking stragglers, not bandwidth: the
# size of the worker's portal probe (dedloc_worker.portal.measure_link).
ROUND_MIN_BYTES = 4 * 1024 * 1024


def link_figures(link: LinkReport, now: float) -> tuple[float, float, str]:
    """(upload, download) in bytes per second the planner uses for a peer, and their source, "round" or "portal".

    What the peer's last round achieved (payload bytes each way over its seconds) where that round is newer than
    the portal measurement, at most ``ROUND_FRESH_S`` old, and moved at least ``ROUND_MIN_BYTES`` each way; the
    portal measurement otherwise. A round's figure is a floor, not a ceiling: a peer that is not its group's
    bottleneck finishes when the slowest member does, and its bytes follow the share the plan gave it, so
    planning with a figure below the measured one would feed the plan back into its own input (a small share, a
    slow-looking peer, a smaller share). Above it, the round shows what the portal probe missed (a portal farther
    away or busier than the peers); a peer whose probe failed is planned from its rounds alone.
    """
    fresh = 0.0 < link.round_seconds and 0.0 < link.round_ended and now - link.round_ended <= ROUND_FRESH_S
    if (fresh and link.round_ended >= link.measured_at
            and min(link.round_sent_bytes, link.round_received_bytes) >= ROUND_MIN_BYTES):
        upload, download = link.round_sent_bytes / link.round_seconds, link.round_received_bytes / link.round_seconds
        if upload > link.upload_bps or download > link.download_bps:
            return max(upload, link.upload_bps), max(download, link.download_bps), "round"
    return link.upload_bps, link.download_bps, "portal"


def attestation_floor(peers: list[PeerProfile], vector_bytes: float) -> float:
    """The least share of the vector each sender that may aggregate gets in a live plan (see ATTESTATION_SHARE).

    On a 100 MB model that is 0.26% each (near-optimal plans stay near-optimal); on a model of a few parts, half the
    vector spread evenly.
    """
    senders = max(sum(1 for p in peers if p.sends and p.can_aggregate), 1)
    return min(ATTESTATION_SHARE / senders, ATTESTATION_PARTS * GRADIENT_PART_BYTES / vector_bytes)


@dataclass(frozen=True)
class LinkSeen:
    """A peer online now, as its owner's token and its signed metrics record describe it."""

    peer_key: str
    peer_id: str
    username: str
    link: LinkReport
    hardware: str = ""  # the worker's own words, "cuda: <GPU>" or "cpu: N threads"
    samples_per_second: float = 0.0  # its training throughput, as its metrics record reports it
    reachability: str = ""  # how its mode was decided (contract.REACHABILITY), as its metrics record reports it


def profiles_of(peers: Sequence[LinkSeen], now: Optional[float] = None) -> list[PeerProfile]:
    """The planner's view of the peers with a figure for their link (the others keep hivemind's split): their
    bandwidths (``link_figures`` at ``now``, unix seconds, default the current time), their measured compute (the
    median trainer's for one that has not measured its own yet), and for a peer that trains on its CPU, what
    aggregating costs its training."""
    now = time.time() if now is None else now
    profiles = []
    # A peer that has just joined reports its link before its first epoch, without a rate yet: it is planned as
    # fast as the swarm's median trainer (0 costs its aggregating nothing and would load it up until the next plan).
    rates = [peer.samples_per_second for peer in peers if not peer.link.aux and peer.samples_per_second > 0]
    typical = statistics.median(rates) if rates else 0.0
    for peer in peers:
        upload, download, _ = link_figures(peer.link, now)
        if upload > 0 and download > 0:
            rate = 0.0 if peer.link.aux else peer.samples_per_second or typical
            profiles.append(PeerProfile(peer.peer_id, rate, upload, download, client_mode=peer.link.client_mode,
                                        aux=peer.link.aux, **cpu_cost(peer.hardware)))
    return profiles


def cpu_cost(hardware: str) -> dict:
    """A CPU peer aggregates on the cores it trains on; a GPU peer's training does not wait for its CPU."""
    if hardware.startswith("cpu"):
        return dict(reduce_bps=CPU_REDUCE_BPS, reduce_costs_training=True)
    return {}


def step_options(config: RunConfig) -> StepOptions:
    """What the step model needs from the run: its global batch, delayed parameter updates, its group size."""
    opt = config.optimizer
    return StepOptions(target_batch_size=config.target_batch_size, overlap=opt.delay_grad_averaging,
                       group_size=opt.group_size)


def group_bits(plan: Plan) -> dict[str, str]:
    """Each peer's group as the bits of hivemind's group key: group i of G is i in ceil(log2 G) binary digits.
    Peers with the same bits look for each other under the same DHT key, and only there (docs/averaging.md#groups).
    {} for a plan of one group."""
    if len(plan.groups) < 2:
        return {}
    width = max(1, (len(plan.groups) - 1).bit_length())
    return {peer: format(index, f"0{width}b") for index, group in enumerate(plan.groups) for peer in group}


def group_of(plan: Plan, peer_id: str) -> int:
    """The index of the peer's averaging group in the plan (0 when the plan has one group)."""
    return next((index for index, group in enumerate(plan.groups) if peer_id in group), 0)


def role_of(link: LinkReport) -> str:
    return "client" if link.client_mode else "aux" if link.aux else "aggregator"


class PlanKeeper:
    """Keeps one run's averaging plan current. ``update`` once per poll; returns the record to publish."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic, min_interval_s: float = 30.0,
                 config: Optional[RunConfig] = None, wall_clock: Callable[[], float] = time.time):
        """:param wall_clock: unix seconds, the clock the workers date their rounds and measurements with"""
        self.settings, self.clock, self.min_interval_s, self.wall_clock = settings, clock, min_interval_s, wall_clock
        self.step = step_options(config) if config is not None else None  # None: plan the round alone
        self.replanner: Optional[Replanner] = None
        self.vector_bytes = 0
        self.record: Optional[PlanRecord] = None
        self.row_id: Optional[int] = None

    def update(self, session: Session, run: Run, peers: Sequence[LinkSeen]) -> Optional[PlanRecord]:
        """Re-plan if the peers call for it; note the measured round time; the plan to publish now, or None."""
        now = self.wall_clock()
        profiles = profiles_of(peers, now)
        vector_bytes = max((peer.link.vector_bytes for peer in peers), default=0)
        if len(profiles) >= 2 and vector_bytes > 0:
            if vector_bytes != self.vector_bytes:  # a new task or model: old plans say nothing about it
                # hold_back=False: the workers' averager streams results to zero-share peers in planned groups
                self.replanner = Replanner(vector_bytes=vector_bytes, clock=self.clock, hold_back=False,
                                           min_interval_s=self.min_interval_s, step=self.step,
                                           min_share=functools.partial(attestation_floor, vector_bytes=vector_bytes))
                self.vector_bytes = vector_bytes
            try:
                plan = self.replanner.update(profiles)
            except PlanningError as e:  # e.g. nobody left who may aggregate: keep hivemind's own split
                logger.warning("no averaging plan for these peers: %s", e)
                plan = None
            if plan is not None:
                self._adopt(session, run, plan, peers, self.replanner.last_reason, now)
        self._note_measured(session, peers)
        return self.record

    def _adopt(self, session: Session, run: Run, plan: Plan, peers: Sequence[LinkSeen], reason: str,
               now: float) -> None:
        issued_at = time.time()
        figures = {peer.peer_id: link_figures(peer.link, now) for peer in peers}
        groups = group_bits(plan)
        signature = tokens.sign_plan(session, self.settings, run,
                                     plan_payload(plan.shares, plan.predicted_seconds, issued_at, groups))
        self.record = PlanRecord(shares=plan.shares, predicted_seconds=plan.predicted_seconds, issued_at=issued_at,
                                 signature=signature, groups=groups)
        row = AveragingPlan(
            run_id=run.id, vector_bytes=self.vector_bytes, predicted_seconds=plan.predicted_seconds,
            lower_bound_seconds=plan.lower_bound_seconds, reason=reason[:200],
            # peer_key: the plan's public view labels each peer with its key's fingerprint, as its owner's page does
            peers=[dict(peer_id=peer.peer_id, peer_key=peer.peer_key, username=peer.username,
                        share=plan.shares.get(peer.peer_id, 0.0), role=role_of(peer.link),
                        # the figures planned with, and whether the portal probe or a round gave them
                        upload_bps=figures[peer.peer_id][0], download_bps=figures[peer.peer_id][1],
                        bandwidth_from=figures[peer.peer_id][2],
                        # the kind only ("cuda", "cpu"): the public plan does not name a volunteer's GPU model
                        device=peer.hardware.split(":", 1)[0] if peer.hardware else "",
                        # what the solution gives it to do, and its averaging group (docs/averaging.md#groups)
                        step_role=plan.roles.get(peer.peer_id, ""), group=group_of(plan, peer.peer_id),
                        # found unreachable or client by choice: the plan view says which (no address in it)
                        reachability=peer.reachability)
                   for peer in peers if peer.peer_id in plan.shares],
        )
        session.add(row)
        session.flush()
        self.row_id = row.id
        step = f", {plan.step_seconds:.3f} s per step" if plan.step_seconds is not None else ""
        logger.info("new averaging plan (%s): predicted %.3f s per round%s, bound %.3f s",
                    reason, plan.predicted_seconds, step, plan.lower_bound_seconds)

    def _note_measured(self, session: Session, peers: Sequence[LinkSeen]) -> None:
        """The median round time the peers report under the current plan."""
        if self.row_id is None:
            return
        rounds = [peer.link.round_seconds for peer in peers if peer.link.round_planned and peer.link.round_seconds]
        if rounds:
            row = session.scalar(select(AveragingPlan).where(AveragingPlan.id == self.row_id))
            if row is not None:
                row.measured_seconds = statistics.median(rounds)
