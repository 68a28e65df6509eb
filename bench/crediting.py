"""How long crediting one epoch takes: N simulated peers in all-reduce groups of 16, every claim confirmed.

    python -m bench.crediting [--peers 1000] [--repeats 5]

Peers are rows in the issued-token table (no RSA work) and records built in memory; the time measured is
``credit_epochs`` on a migrated SQLite database in a temporary folder: inserting the claims and receipts and
settling every claim. See docs/benchmarks.md#crediting-bench.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from dedloc_common.contract import EpochContribution, MetricsRecord

from app.core.clock import utcnow
from app.core.database import make_engine, make_sessionmaker, migrate
from app.credit.ledger import SignedMetrics
from app.credit.settlement import credit_epochs
from app.models import IssuedPeerToken
from app.runs import registry

GROUP_SIZE = 16
SAMPLES = 100


def simulated_epoch(session, run, peers: int, epoch: int = 1) -> list[SignedMetrics]:
    """Token rows for ``peers`` peers and their records for one epoch, each confirmed by its group."""
    keys = [f"{i:064x}" for i in range(peers)]
    ids = [f"peer{i}" for i in range(peers)]
    if epoch == 1:
        # the coordinator has watched the run for an hour (no snapshots): the ceiling holds none of these claims
        run.created_at = utcnow() - timedelta(hours=1)
        session.add_all(IssuedPeerToken(run_id=run.id, username=f"user{i % 100}", peer_public_key="-",
                                        peer_id=ids[i], peer_key=keys[i], expires_at=utcnow() + timedelta(hours=1))
                        for i in range(peers))
        session.commit()
    records = []
    for i in range(peers):
        start = i - i % GROUP_SIZE
        group = f"e{epoch}g{start}"
        members = range(start, min(start + GROUP_SIZE, peers))
        aggregated = {group: {ids[j]: float(SAMPLES) for j in members if j != i}}
        contribution = EpochContribution(epoch=epoch, samples=SAMPLES, loss_sum=1.0, mini_steps=1, seconds=1.0,
                                         group=group, aggregated=aggregated, members=[ids[j] for j in members])
        records.append(SignedMetrics(keys[i], MetricsRecord(username=f"user{i % 100}", epoch=epoch + 1,
                                                            samples_per_second=100.0, time=0.0,
                                                            recent=[contribution])))
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.crediting", description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{Path(folder) / 'bench.sqlite3'}"
        migrate(url)
        engine = make_engine(url)
        times = []
        with make_sessionmaker(engine)() as session:
            run = registry.create_run(session, slug="bench", title="Bench")
            for epoch in range(1, args.repeats + 1):
                records = simulated_epoch(session, run, args.peers, epoch)
                started = time.perf_counter()
                credit_epochs(session, run, records)
                times.append(time.perf_counter() - started)
        engine.dispose()
    print(f"crediting one epoch of {args.peers} peers (groups of {GROUP_SIZE}, SQLite): "
          f"median {statistics.median(times):.3f} s over {len(times)} epochs (min {min(times):.3f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
