"""This peer's side of adaptive averaging: report its link, follow the coordinator's plan.

The worker measures its upload and download once at join (``portal.measure_link``) and repeats them in every
metrics record with its role and its last all-reduce's duration; the coordinator plans from those reports and
publishes a plan signed by the run's authority. A thread reads the newest plan every second; after each epoch the
training loop gives it to the gradient averager (``averaging.PlannedGradientAverager.set_plan``), which announces
its share to its group, and puts the averager in the plan's group (``group_bits_for``, docs/averaging.md#groups).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Optional

from dedloc_common.contract import LinkReport, PlanRecord
from .records import read_plan

ROUND_QUERY_TIMEOUT = 2.0  # seconds to wait for the averager process to say how its last round went
PLAN_POLL = 1.0  # seconds between two reads of the run's plan: a new plan reaches the next round


class PlanFollower(threading.Thread):
    """Keeps the gradient averager on the newest authentic plan and the link report current.

    A DHT read is slow on a busy machine and made peers late for matchmaking when done in the training loop
    (docs/hivemind.md#throughput-on-shared-cores), so this thread reads the plan and the loop only applies it.

    :param link: what this peer measured of its link at join (bandwidths in bytes per second) and its role
    :param check: ``admission.TokenCheck`` holding the run's authority key, which signs plans
    :param interval: seconds between two reads of the plan
    """

    def __init__(self, dht, run_id: str, check, link: LinkReport, interval: float = PLAN_POLL):
        super().__init__(name="dedloc-plan", daemon=True)
        self.dht, self.run_id, self.check, self.link, self.interval = dht, run_id, check, link, interval
        self.newest: Optional[PlanRecord] = None  # written by this thread
        self.applied: Optional[PlanRecord] = None  # by the training loop
        self.halted = threading.Event()

    def run(self) -> None:
        while not self.halted.is_set():
            try:
                plan = read_plan(self.dht, self.run_id, self.check)
                if plan is not None and (self.newest is None or plan.issued_at > self.newest.issued_at):
                    self.newest = plan
            except Exception as e:  # the DHT briefly unavailable: the averager keeps the plan it has
                if not self.halted.is_set():
                    print(f"plan: {type(e).__name__}: {e}; retrying", flush=True)
            self.halted.wait(self.interval)

    def halt(self, timeout: float = 10.0) -> None:
        """Stop before the DHT shuts down (the thread uses it); wait at most ``timeout`` seconds."""
        self.halted.set()
        self.join(timeout=timeout)

    def after_epoch(self, averager) -> LinkReport:
        """Apply a newer plan if one was read; returns the link report with the last round's figures."""
        plan = self.newest
        if plan is not None and plan is not self.applied:
            averager.set_plan(plan.shares)
            self.applied = plan
        if self.applied is not None:
            # every epoch: hivemind moves an averager to another group key after each round it joins
            averager.set_group_bits(group_bits_for(self.applied, str(averager.peer_id)), wait=False)
        try:
            last = averager.last_round(timeout=ROUND_QUERY_TIMEOUT)
        except Exception:  # the averager is busy or shutting down: report the previous figures
            last = None
        if last is not None and last.complete:
            self.link = self.link.copy(update=dict(round_seconds=round(last.seconds, 4), round_planned=last.planned))
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


def link_report(measured: Optional[tuple[float, float]], params, client_mode: bool, aux: bool) -> LinkReport:
    """The initial report: measured (upload, download) bytes/s or None, and the averaged vector's size."""
    upload, download = measured or (0.0, 0.0)
    vector_bytes = sum(p.numel() for p in params if p.requires_grad) * 4  # gradients are averaged as float32
    return LinkReport(upload_bps=float(upload), download_bps=float(download), client_mode=client_mode, aux=aux,
                      vector_bytes=int(vector_bytes))
