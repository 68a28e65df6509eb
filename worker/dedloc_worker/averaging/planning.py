"""This peer's side of adaptive averaging: report its link, follow the coordinator's plan.

The worker measures its upload and download at join (``portal.client.measure_link``) and again every ``LINK_REMEASURE``
seconds in a thread of its own (``LinkMeter``), and repeats them in every metrics record with its role and what its
last all-reduce achieved with its peers (seconds, and the payload bytes it sent and received:
``averaging.planned.Transfers``); the coordinator plans from those reports and publishes a plan signed by the run's
authority. A thread reads the newest plan every second; after each epoch the
training loop gives it to the gradient averager (``averaging.planned.PlannedGradientAverager.set_plan``), which
announces its share and the signed plan to its group, where every member checks them against the run's authority
(``averaging.announcements``, docs/averaging.md#checked-shares), and puts the averager in the plan's group
(``group_bits_for``, docs/averaging.md#groups). The averager is built with the same authority key (``authority``).
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Callable, Optional

from dedloc_common.contract import LinkReport, OptimizerOptions, PlanRecord

from dedloc_worker.errors import DHT_FAILURES
from dedloc_worker.swarm.records import read_plan

ROUND_QUERY_TIMEOUT = 2.0  # seconds to wait for the averager process to say how its last round went
# seconds between two reads of the run's plan. Plans change at most every plan_interval (30 s) or when a planned
# peer leaves, and each read is signed DHT RPCs: reading every second cost more CPU than a plan 3 s late does
PLAN_POLL = 3.0
LINK_REMEASURE = 600.0  # seconds between two measurements of this peer's link to the portal
# seconds a due measurement waits for an averaging round to end, so that the probe's transfers and a round's rarely
# share the link (a round ends every epoch; a peer that is paused or between epochs measures after this)
QUIET_WAIT = 120.0


class LinkMeter(threading.Thread):
    """Re-measures this peer's link every ``interval`` seconds in its own thread, so training never waits for it.

    A due measurement starts as soon as the follower reports a round's end (``round_ended``), or after
    ``quiet_wait`` seconds without one. A failed measurement (the portal unreachable) keeps the previous figures.

    :param measure: () -> (upload, download) in bytes per second, or None (``portal.client.measure_link`` for this run)
    :ivar latest: (upload, download, when: unix seconds) of the newest measurement; None before the first
    """

    def __init__(self, measure: Callable[[], Optional[tuple[float, float]]], interval: float = LINK_REMEASURE,
                 quiet_wait: float = QUIET_WAIT, clock: Callable[[], float] = time.time):
        super().__init__(name="dedloc-link-meter", daemon=True)
        self.measure, self.interval, self.quiet_wait, self.clock = measure, interval, quiet_wait, clock
        self.latest: Optional[tuple[float, float, float]] = None  # written by this thread only
        self.halted = threading.Event()
        self._round_ended = threading.Event()

    def run(self) -> None:
        while not self.halted.wait(self.interval):
            self._round_ended.clear()
            self._round_ended.wait(self.quiet_wait)
            if self.halted.is_set():
                return
            try:
                measured = self.measure()
            except Exception as e:  # a measurement is never worth ending the worker for
                print(f"link measurement: {type(e).__name__}: {e}; keeping the previous figures", flush=True)
                measured = None
            if measured is not None:
                self.latest = (float(measured[0]), float(measured[1]), float(self.clock()))

    def round_ended(self) -> None:
        """An averaging round has just ended: a due measurement may start now."""
        self._round_ended.set()

    def halt(self, timeout: float = 10.0) -> None:
        self.halted.set()
        self._round_ended.set()
        self.join(timeout=timeout)


class PlanFollower(threading.Thread):
    """Keeps the gradient averager on the newest authentic plan and the link report current.

    A DHT read is slow on a busy machine and made peers late for matchmaking when done in the training loop
    (docs/hivemind.md#throughput-on-shared-cores), so this thread reads the plan and the loop only applies it.

    :param link: what this peer measured of its link at join (bandwidths in bytes per second) and its role
    :param check: ``admission.gate.TokenCheck`` holding the run's authority key, which signs plans
    :param interval: seconds between two reads of the plan
    :param meter: the ``LinkMeter`` whose newer measurements replace the link's figures; None: the join's stay
    """

    def __init__(self, dht, run_id: str, check, link: LinkReport, interval: float = PLAN_POLL,
                 meter: Optional[LinkMeter] = None):
        super().__init__(name="dedloc-plan", daemon=True)
        self.dht, self.run_id, self.check, self.link, self.interval = dht, run_id, check, link, interval
        self.meter = meter
        self.newest: Optional[PlanRecord] = None  # written by this thread
        self.applied: Optional[PlanRecord] = None  # by the training loop
        self.halted = threading.Event()

    def run(self) -> None:
        while not self.halted.is_set():
            try:
                plan = read_plan(self.dht, self.run_id, self.check)
                if plan is not None and (self.newest is None or plan.issued_at > self.newest.issued_at):
                    self.newest = plan
            except DHT_FAILURES as e:  # the DHT briefly unavailable: the averager keeps the plan it has
                if not self.halted.is_set():
                    print(f"plan: {type(e).__name__}: {e}; retrying", flush=True)
            self.halted.wait(self.interval)

    @property
    def authority(self):
        """The run's authority key, which signs plans: the gradient averager checks its peers' plans with it."""
        return self.check.authority

    def halt(self, timeout: float = 10.0) -> None:
        """Stop before the DHT shuts down (the thread uses it); wait at most ``timeout`` seconds."""
        self.halted.set()
        self.join(timeout=timeout)

    def after_epoch(self, averager) -> LinkReport:
        """Apply a newer plan if one was read; returns the link report with the newest measurement and the last
        complete round's figures."""
        plan = self.newest
        if plan is not None and plan is not self.applied:
            averager.set_plan(plan)  # signed: its peers check the share it announces against it
            if plan.ceiling is not None:  # the run's ceiling in force, for the weight cap (docs/averaging.md#ceiling)
                averager.set_ceiling(plan.ceiling)
            self.applied = plan
        if self.applied is not None:
            # every epoch: hivemind moves an averager to another group key after each round it joins
            averager.set_group_bits(group_bits_for(self.applied, str(averager.peer_id)), wait=False)
        try:
            last = averager.finished_round(timeout=ROUND_QUERY_TIMEOUT)
        except Exception:  # the averager is busy or shutting down: report the previous figures
            last = None
        # complete: every part aggregated and returned (an incomplete round's figures say nothing of the link)
        if last is not None and last.complete and last.ended > last.began:
            self.link = self.link.copy(update=dict(
                round_seconds=round(last.seconds, 4), round_planned=last.planned, round_ended=float(last.ended),
                round_sent_bytes=int(last.transfers.sent), round_received_bytes=int(last.transfers.received)))
        if self.meter is not None:
            self.meter.round_ended()
            latest = self.meter.latest
            if latest is not None and latest[2] > self.link.measured_at:
                upload, download, measured_at = latest
                self.link = self.link.copy(update=dict(upload_bps=upload, download_bps=download,
                                                       measured_at=measured_at))
        return self.link


def group_bits_for(plan: PlanRecord, peer_id: str) -> str:
    """The bits of this peer's group key under ``plan``: its own group; a group picked by its PeerID where the plan
    does not name it yet (a newcomer joins a group until the next plan places it); "" for a plan of one group."""
    if not plan.groups:
        return ""
    if peer_id in plan.groups:
        return plan.groups[peer_id]
    keys = sorted(set(plan.groups.values()))
    return keys[int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big") % len(keys)]


# Bytes one gradient element takes on the wire under each of the run's compressions (uint8: hivemind's quantization
# adds a 256-entry codebook per part, under 1% of a 128 KiB part).
WIRE_BYTES = {"none": 4, "fp16": 2, "uint8": 1}
DEFAULT_COMPRESSION = OptimizerOptions().compression


def link_report(measured: Optional[tuple[float, float]], params, client_mode: bool, aux: bool,
                measured_at: Optional[float] = None, compression: str = DEFAULT_COMPRESSION) -> LinkReport:
    """The initial report: measured (upload, download) bytes/s or None (taken at ``measured_at``, unix seconds;
    now if not given), and the averaged vector's size on the wire under the run's gradient ``compression``."""
    upload, download = measured or (0.0, 0.0)
    vector_bytes = sum(p.numel() for p in params if p.requires_grad) * WIRE_BYTES[compression]
    when = 0.0 if measured is None else float(time.time() if measured_at is None else measured_at)
    return LinkReport(upload_bps=float(upload), download_bps=float(download), client_mode=client_mode, aux=aux,
                      vector_bytes=int(vector_bytes), measured_at=when)
