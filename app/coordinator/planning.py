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
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from dedloc_common.contract import GRADIENT_PART_BYTES, LinkReport, PlanRecord, RunConfig, ceiling_payload, plan_payload
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.authority import tokens
from app.core.config import Settings
from app.credit.ceiling import in_force as ceiling_in_force
from app.models import AveragingPlan, Run
from app.planner import (
    PeerProfile,
    Plan,
    PlanningError,
    Replanner,
    RoundObservation,
    StepOptions,
    fit_round_costs,
    plan_round_seconds,
)

logger = logging.getLogger("dedloc.coordinator")
# Share of the vector the live plan spreads evenly over the senders, at most. hivemind hands out whole parts, so a
# peer given a sliver aggregates nothing and cannot attest the others: each sender gets ATTESTATION_PARTS parts'
# worth, or its even slice of ATTESTATION_SHARE on a small vector (docs/averaging.md#attestation-floor).
ATTESTATION_SHARE = 0.5
ATTESTATION_PARTS = 2
# Bytes per second of parts a peer aggregates: hivemind reduces on the host CPU, in the averager's process, GPU
# peer or not. Four peers on 2 cores are CPU-bound near 240 Mbit/s each way
# (docs/benchmarks.md#staying-within-the-cpu), 60 MB/s per core (docs/averaging.md#step).
CPU_REDUCE_BPS = 60e6
# The part of each second a GPU peer's host spends aggregating that its training loses: its host feeds the GPU
# (data, kernel launches, the offloaded optimizer step under delayed updates). An assumption, not measured here
# (docs/averaging.md#step); a CPU peer loses all of it.
GPU_REDUCE_COST = 0.25
# A round's figures older than this say little about the link now (the worker re-measures its portal link every
# 10 minutes: dedloc_worker.averaging.planning.LINK_REMEASURE).
ROUND_FRESH_S = 600.0
# Below this many bytes each way a round's time is mostly latency and matchmaking stragglers, not bandwidth: the
# size of the worker's portal probe (dedloc_worker.portal.client.measure_link).
ROUND_MIN_BYTES = 4 * 1024 * 1024
# The round model is fitted from the newest this many measured rounds (one per peer and round): a few minutes of a
# small swarm, so that the fit follows a swarm whose links or load change.
ROUNDS_FITTED = 200


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
                                        aux=peer.link.aux, **reduce_cost(peer.hardware)))
    return profiles


def reduce_cost(hardware: str) -> dict:
    """What aggregating costs a peer, by the hardware its record names: a CPU peer aggregates on the cores it trains
    on and loses that training; a GPU peer's host aggregates as fast, and its GPU loses ``GPU_REDUCE_COST`` of it.
    A peer that named no hardware is planned as before there was a compute term (aggregating costs nothing)."""
    if hardware.startswith("cpu"):
        return dict(reduce_bps=CPU_REDUCE_BPS, reduce_costs_training=1.0)
    if hardware.startswith("cuda"):
        return dict(reduce_bps=CPU_REDUCE_BPS, reduce_costs_training=GPU_REDUCE_COST)
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
    """What the peer's flags allow: "client" (never aggregates), "aux" (trains nothing) or "aggregator" (may
    aggregate). How much it aggregates is the plan's decision (``Plan.roles``, stored as ``step_role``)."""
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
        self.rounds: deque[RoundObservation] = deque(maxlen=ROUNDS_FITTED)
        self.round_seen: dict[str, float] = {}  # each peer's last round fitted (its round_ended), so none twice
        self.measured: deque[float] = deque(maxlen=ROUNDS_FITTED)  # round seconds under the current plan
        self.measured_seen: dict[str, float] = {}  # each peer's last round counted there (its round_ended)
        self.costs = fit_round_costs((), GRADIENT_PART_BYTES)
        self.ceiling: Optional[float] = None  # the run's ceiling in force, samples/s, as the last record carries it

    def update(self, session: Session, run: Run, peers: Sequence[LinkSeen]) -> Optional[PlanRecord]:
        """Re-plan if the peers call for it; note the measured round time; the plan to publish now, or None. The
        record carries the run's ceiling in force, re-signed when that changes under an unchanged plan."""
        now = self.wall_clock()
        self.ceiling = round(ceiling_in_force(session, run).samples_per_second, 3)
        profiles = profiles_of(peers, now)
        vector_bytes = max((peer.link.vector_bytes for peer in peers), default=0)
        if vector_bytes != self.vector_bytes:
            self.rounds.clear()  # a new task or model: rounds of another vector say nothing about it
        self._observe(peers, vector_bytes, now)
        if len(profiles) >= 2 and vector_bytes > 0:
            # the first plan, or a new task or model: old plans say nothing about it
            if self.replanner is None or vector_bytes != self.vector_bytes:
                # hold_back=False: the workers' averager streams results to zero-share peers in planned groups
                self.replanner = Replanner(vector_bytes=vector_bytes, clock=self.clock, hold_back=False,
                                           min_interval_s=self.min_interval_s, step=self.step,
                                           min_share=functools.partial(attestation_floor, vector_bytes=vector_bytes))
                self.vector_bytes = vector_bytes
            self.replanner.costs = self.costs  # new plans and the hysteresis both weigh the fitted model
            try:
                # a trainer without a rate yet is planned at the median's (profiles_of): a guess the plan names
                guessed = [peer.peer_id for peer in peers if not peer.link.aux and peer.samples_per_second <= 0]
                plan = self.replanner.update(profiles, guessed)
            except PlanningError as e:  # e.g. nobody left who may aggregate: keep hivemind's own split
                logger.warning("no averaging plan for these peers: %s", e)
                plan = None
            if plan is not None:
                self._adopt(session, run, plan, peers, self.replanner.last_reason, now)
        if self.record is not None and self.record.ceiling != self.ceiling:
            self.record = self._signed(session, run, self.record.shares, self.record.predicted_seconds,
                                       self.record.groups)
        self._note_measured(session, peers, profiles)
        return self.record

    def _observe(self, peers: Sequence[LinkSeen], vector_bytes: int, now: float) -> None:
        """Add the rounds the peers report that were not fitted yet, and refit the round model."""
        for peer in peers:
            link = peer.link
            fresh = (link.round_seconds > 0 and link.round_ended > self.round_seen.get(peer.peer_id, 0.0)
                     and link.vector_bytes == vector_bytes and link.round_sent_bytes + link.round_received_bytes > 0)
            upload, download, _ = link_figures(link, now)
            if fresh and upload > 0 and download > 0:
                self.round_seen[peer.peer_id] = link.round_ended
                self.rounds.append(RoundObservation(link.round_seconds, link.round_sent_bytes,
                                                    link.round_received_bytes, upload, download))
        self.costs = fit_round_costs(self.rounds, GRADIENT_PART_BYTES)

    def _adopt(self, session: Session, run: Run, plan: Plan, peers: Sequence[LinkSeen], reason: str,
               now: float) -> None:
        figures = {peer.peer_id: link_figures(peer.link, now) for peer in peers}
        self.record = self._signed(session, run, plan.shares, plan.predicted_seconds, group_bits(plan))
        row = AveragingPlan(
            run_id=run.id, vector_bytes=self.vector_bytes, predicted_seconds=plan.predicted_seconds,
            lower_bound_seconds=plan.lower_bound_seconds, reason=reason[:200],
            # peer_key: the plan's public view labels each peer with its key's fingerprint, as its owner's page does
            peers=[dict(peer_id=peer.peer_id, peer_key=peer.peer_key, username=peer.username,
                        share=plan.shares.get(peer.peer_id, 0.0), role=role_of(peer.link),
                        # the figures planned with, and whether the portal probe or a round gave them
                        upload_bps=figures[peer.peer_id][0], download_bps=figures[peer.peer_id][1],
                        bandwidth_from=figures[peer.peer_id][2],
                        # its own measured rate, samples/s; 0 before its first (planned at the median's)
                        samples_per_second=peer.samples_per_second,
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
        # rounds the peers had already reported belong to the previous plan
        self.measured = deque(maxlen=ROUNDS_FITTED)
        self.measured_seen = {peer.peer_id: peer.link.round_ended for peer in peers}
        step = f", {plan.step_seconds:.3f} s per step" if plan.step_seconds is not None else ""
        logger.info("new averaging plan (%s): predicted %.3f s per round%s, bound %.3f s",
                    reason, plan.predicted_seconds, step, plan.lower_bound_seconds)

    def _signed(self, session: Session, run: Run, shares: dict[str, float], predicted_seconds: float,
                groups: dict[str, str]) -> PlanRecord:
        """A plan record issued now with the ceiling in force, signed by the run's authority."""
        assert self.ceiling is not None  # update() reads the ceiling in force before it signs anything
        issued_at = time.time()
        signature = tokens.sign_plan(session, self.settings, run, plan_payload(
            shares, predicted_seconds, issued_at, groups))
        ceiling_signature = tokens.sign_plan(session, self.settings, run, ceiling_payload(self.ceiling, issued_at))
        return PlanRecord(shares=shares, predicted_seconds=predicted_seconds, issued_at=issued_at,
                          signature=signature, groups=groups, ceiling=self.ceiling,
                          ceiling_signature=ceiling_signature)

    def _note_measured(self, session: Session, peers: Sequence[LinkSeen], profiles: Sequence[PeerProfile]) -> None:
        """The median of the rounds the peers reported under the current plan (the newest ``ROUNDS_FITTED``; one
        peer's last round alone was as likely a straggler's as not), and what the fitted model predicts for it."""
        if self.row_id is None:
            return
        row = session.scalar(select(AveragingPlan).where(AveragingPlan.id == self.row_id))
        if row is None:
            return
        for peer in peers:  # each round once, and only rounds that ended under this plan
            link = peer.link
            if link.round_planned and link.round_seconds > 0 and link.round_ended != self.measured_seen.get(
                    peer.peer_id, 0.0):
                self.measured_seen[peer.peer_id] = link.round_ended
                self.measured.append(link.round_seconds)
        if self.measured:
            row.measured_seconds = statistics.median(self.measured)
        current = self.replanner.current if self.replanner is not None else None
        if self.costs.rounds and current is not None:
            row.latency_seconds, row.part_seconds = self.costs.latency_seconds, self.costs.part_seconds
            row.fitted_rounds = self.costs.rounds
            planned = [p for p in profiles if p.peer in current.shares]
            try:
                row.fitted_seconds = plan_round_seconds(planned, current, self.vector_bytes, hold_back=False,
                                                        costs=self.costs)
            except PlanningError:  # a planned peer left: the next poll re-plans
                pass
