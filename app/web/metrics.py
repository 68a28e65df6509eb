"""Prometheus /metrics: one gauge family per swarm figure, labelled by run, read from the database per scrape."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from app.credit import ledger
from app.runs import registry
from app.web.views import current_swarm

router = APIRouter()

GAUGES = {
    "peers_online": "peers with a fresh progress record",
    "samples_per_second": "collaboration throughput, samples per second",
    "epoch": "collaboration epoch (optimizer steps taken)",
    "loss": "mean training loss of the newest epoch",
    "samples_total": "samples credited to contributors",
    "target_batch_size": "samples per collaboration step",
}


class SwarmCollector:
    def __init__(self, sessions):
        self.sessions = sessions

    def collect(self):
        families = {name: GaugeMetricFamily(f"dedloc_{name}", doc, labels=["run"]) for name, doc in GAUGES.items()}
        credited = GaugeMetricFamily("dedloc_samples_credited", "samples credited to contributors", labels=["run"])
        held = GaugeMetricFamily("dedloc_samples_held", "samples claimed but held back for review", labels=["run"])
        with self.sessions() as session:
            credit = ledger.credit_by_run(session)
            for run in registry.list_runs(session):
                swarm = current_swarm(session, run)
                for name, family in families.items():
                    value = getattr(swarm, name)
                    if value is not None:
                        family.add_metric([run.slug], float(value))
                credited_samples, held_samples = credit.get(run.id, (0, 0))
                credited.add_metric([run.slug], float(credited_samples))
                held.add_metric([run.slug], float(held_samples))
        yield from families.values()
        yield from (credited, held)


def make_registry(sessions) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SwarmCollector(sessions))
    return registry


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
