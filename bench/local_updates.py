"""Large-batch against local-updates (DiLoCo) on emulated slow links: efficiency, bytes per sample, held-out loss
(docs/benchmarks.md#local-updates).

    python -m bench.local_updates [--quick] [--out bench/results/local_updates.json]

Two peers, each in its own network namespace on a star of ``tc tbf`` links (``bench.emulate_averaging.Star``, CUBIC),
run the worker's optimizer code (``swarm.node.create_dht`` and ``training.options.create_optimizer`` with a
``RunConfig``; no coordinator and no plan: hivemind's own split) on tiny-lm's transformer, trained on the first 90% of
its text and evaluated on the last 10%. The link rate is set in each run from the solo rates measured first: the
project's bound for one fp16 gradient round of the model (``app.planner.lower_bound_seconds``) is ``RATIO`` times the
compute of one large-batch step (``TARGET_BATCH`` samples at the sum of the solo rates).

- Solo: ``PEERS`` processes at once on the same cores, no hivemind, each doing what a peer does per mini-batch (an
  AdamW step after each one for local updates; one per peer's share of the global batch for large-batch), before
  and after the swarm runs; the two are averaged.
- Swarm: one run per case (``CASES``). The window runs from the end of the first rounds (``skip``) to the end of the
  last: swarm samples are what the rounds averaged in (a sample lost in a failed round does not count),
  efficiency = swarm samples/s over the solo sum, bytes per sample = what the peers' ``eth0`` sent over the window
  (rounds, state rounds, DHT, headers: everything) over those samples; payload per sample comes from the averagers'
  own ``RoundOutcome.transfers``.
- Quality: each peer evaluates its parameters after the last round (local updates: the outer parameters); a single
  process (``baseline``) trains the same number of samples with one AdamW step per ``PEERS * BATCH`` samples (the
  synchronous run DiLoCo compares with: the same total batch per inner step) and, for the large-batch rows and as a
  second figure for local updates, per ``TARGET_BATCH`` samples (what a large-batch run computes).

Needs root (namespaces); without it, it writes one "skipped" row. It removes its namespaces and every process it
started, even on Ctrl-C. Hold the CPU lock while it runs: ``flock /tmp/dedloc-cpu.lock python -m bench.local_updates``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from app.core.processes import spawn, stop_all
from bench import write_results
from bench.emulate_averaging import MBIT, QUEUE_MS, Link, Star, namespaces_unavailable, signals_ignored

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("bench/results")
PEERS = 2
BATCH = 16
TARGET_BATCH = 256  # a large-batch step: 16 mini-batches of 16 across the swarm
MODEL = dict(context=64, width=64, layers=2, heads=4)  # tiny-lm's defaults: 137,088 parameters
LR = 3e-3  # the run's default AdamW
SEED = 0
# The fp16 gradient round's bound over one large-batch step's compute, at the first solo rate: at least 5x (the issue's
# profile) in every row, whose own solo rates move by 10-20% on these shared cores
RATIO = 6.0
HELD_OUT_SHARE = 0.1
EVAL_WINDOWS = 512
# Times for a slow emulated link: a 128 KiB part takes about 0.6 s at 1.7 Mbit/s, so a sender's silence between two
# parts is allowed far more than the loopback's 0.5 s (which dropped senders mid-round)
SWARM_TIMES = dict(matchmaking_time=1.0, averaging_timeout=30.0, next_chunk_timeout=5.0, metadata_expiration=15.0)
SOLO_SECONDS, QUICK_SOLO_SECONDS = 6.0, 4.0
BARRIER_SECONDS = 60.0
COUNTER_PERIOD = 0.25  # seconds between two samples of a peer's counters


@dataclass(frozen=True)
class Case:
    """One swarm run: the algorithm, its outer batch in large-batch steps (local updates), compression, and how many
    rounds to run (``epochs``) of which the first ``skip`` stay out of the window (joining, the first matchmaking)."""

    name: str
    algorithm: str
    compression: str
    epochs: int
    skip: int
    outer_steps: Optional[int] = None  # outer batch = this many TARGET_BATCH; None: the run's default (64)
    outer_momentum: Optional[float] = None  # None: the run's default (DiLoCo's 0.9)
    overlap: bool = True  # local updates: the outer round runs during the next inner steps (overlap_outer_rounds)

    @property
    def outer_batch(self) -> Optional[int]:
        from dedloc_common.contract import OUTER_BATCH_MULTIPLE

        if self.algorithm != "local-updates":
            return None
        return (self.outer_steps or OUTER_BATCH_MULTIPLE) * TARGET_BATCH


# Cases of one algorithm follow each other: a solo measurement after one run serves as the next one's before.
# Large-batch skips more epochs: its first rounds form alone until each peer's tracker has seen the other's record.
CASES = [
    Case("large-batch", "large-batch", "fp16", epochs=16, skip=6),
    Case("large-batch uint8", "large-batch", "uint8", epochs=16, skip=6),
    Case("local-updates", "local-updates", "fp16", epochs=4, skip=1),  # the run's defaults: 64 steps, overlapped
    # each peer waits for its outer round before training on (overlap_outer_rounds false): the overlap's gain
    Case("local-updates waiting", "local-updates", "fp16", epochs=4, skip=1, overlap=False),
    Case("local-updates uint8", "local-updates", "uint8", epochs=4, skip=1),
    Case("local-updates 32 steps", "local-updates", "fp16", epochs=5, skip=1, outer_steps=32),
    Case("local-updates 8 steps", "local-updates", "fp16", epochs=9, skip=1, outer_steps=8),
    Case("local-updates 8 steps waiting", "local-updates", "fp16", epochs=9, skip=1, outer_steps=8, overlap=False),
    # DiLoCo's outer momentum of 0.9 is tuned for hundreds of rounds; a run of a few rounds, as here, with 0.5
    Case("local-updates momentum 0.5", "local-updates", "fp16", epochs=4, skip=1, outer_momentum=0.5),
    # the quality gap at DiLoCo's defaults over more rounds: does it close as the momentum settles?
    Case("local-updates 20 rounds", "local-updates", "fp16", epochs=21, skip=1),
    Case("local-updates 32 steps, 20 rounds", "local-updates", "fp16", epochs=21, skip=1, outer_steps=32),
]
QUICK_CASES = [
    Case("large-batch", "large-batch", "fp16", epochs=10, skip=4),
    Case("local-updates 8 steps", "local-updates", "fp16", epochs=4, skip=1, outer_steps=8),
]


# --- model and data (every process) ------------------------------------------------------------------------------


def make_model():
    import torch
    from dedloc_worker.tasks.tiny_lm import TinyTransformer

    torch.manual_seed(SEED)  # every peer and the baseline start from the same parameters
    return TinyTransformer(**MODEL)


def splits():
    """tiny-lm's text as (train, held-out) byte tensors: the last ``HELD_OUT_SHARE`` is never trained on."""
    from dedloc_worker.tasks.tiny_lm import corpus_bytes

    data = corpus_bytes().long()
    cut = int(len(data) * (1 - HELD_OUT_SHARE))
    return data[:cut], data[cut:]


def windows(data, count: int, generator):
    import torch

    context = MODEL["context"]
    starts = torch.randint(0, len(data) - context - 1, (count,), generator=generator)
    return torch.stack([data[s: s + context + 1] for s in starts.tolist()])


def loss_of(model, batch):
    import torch

    logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))


def held_out_loss(model, held_out) -> float:
    """Mean loss (nats per byte) on ``EVAL_WINDOWS`` fixed windows of the held-out text."""
    import torch

    batch = windows(held_out, EVAL_WINDOWS, torch.Generator().manual_seed(12345))
    with torch.no_grad():
        return float(sum(loss_of(model, chunk) for chunk in batch.split(128)) / len(batch.split(128)))


def parameter_count() -> int:
    return sum(p.numel() for p in make_model().parameters())


# --- roles run as child processes --------------------------------------------------------------------------------


def solo_main(batches_per_step: int, seconds: float) -> None:
    """Train alone for ``seconds``, an AdamW step every ``batches_per_step`` mini-batches; print samples/s."""
    import torch

    torch.set_num_threads(1)
    model, (train, _) = make_model(), splits()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(os.getpid())
    for _ in range(3):  # warm up
        loss_of(model, windows(train, BATCH, generator)).backward()
    optimizer.zero_grad()
    count, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        loss_of(model, windows(train, BATCH, generator)).backward()
        count += 1
        if count % batches_per_step == 0:
            optimizer.step()
            optimizer.zero_grad()
    print(count * BATCH / (time.monotonic() - start))


def baseline_main(batch: int, checkpoints: list[int], out: Path) -> None:
    """One process, one AdamW step per ``batch`` samples (mini-batches of BATCH, gradients accumulated); the held-out
    loss once it has trained each of ``checkpoints`` samples (rounded down to whole steps), written to ``out``."""
    import torch

    torch.set_num_threads(1)
    model, (train, held_out) = make_model(), splits()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(SEED + 1)
    accumulate = max(1, batch // BATCH)
    losses, samples = {}, 0
    for checkpoint in sorted(set(checkpoints)):
        while samples + accumulate * BATCH <= checkpoint:
            for _ in range(accumulate):
                (loss_of(model, windows(train, BATCH, generator)) / accumulate).backward()
            optimizer.step()
            optimizer.zero_grad()
            samples += accumulate * BATCH
        losses[checkpoint] = dict(samples=samples, eval_loss=held_out_loss(model, held_out))
    out.write_text(json.dumps(losses))


def run_config(case: Case):
    from dedloc_common.contract import OptimizerOptions, RunConfig

    options = dict(SWARM_TIMES, lr=LR, compression=case.compression, algorithm=case.algorithm)
    if case.outer_batch:
        options["outer_batch_size"] = case.outer_batch
    if case.outer_momentum is not None:
        options["outer_momentum"] = case.outer_momentum
    if case.outer_batch:
        options["overlap_outer_rounds"] = case.overlap
    return RunConfig(slug="bench", run_id="lu-" + re.sub(r"[^A-Za-z0-9]+", "-", case.name), task="tiny-lm",
                     task_options=MODEL, target_batch_size=TARGET_BATCH, batch_size=BATCH, seed=SEED,
                     optimizer=OptimizerOptions(**options))


def peer_main(spec: dict) -> None:
    """One peer inside its namespace: train until the swarm's epoch ``epochs``, write what each round did, wait for
    the others (a peer that leaves early fails its partner's last round)."""
    import torch
    from dedloc_worker.swarm.node import create_dht
    from dedloc_worker.training.options import create_optimizer

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    began = time.time()
    torch.set_num_threads(1)
    case, work, index = Case(**spec["case"]), Path(spec["work"]), spec["index"]
    initial = [] if index == 0 else wait_for(work / "peer0.addrs").split()
    dht = create_dht(initial, f"/ip4/{spec['ip']}/tcp/0", client_mode=False)
    opt = None
    try:
        if index == 0:
            (work / "peer0.addrs").write_text(" ".join(str(a) for a in dht.get_visible_maddrs()
                                                       if spec["ip"] in str(a)))
        model = make_model()
        opt = create_optimizer(dht, run_config(case), model.parameters(), client_mode=False)
        # start together. Each tracker counts the other peer only once that one has trained (its first record), so
        # the first rounds may form alone: the window leaves them out (``Case.skip``)
        (work / f"peer{index}.ready").write_text("ready")
        for other in range(PEERS):
            wait_for(work / f"peer{other}.ready")
        ready = time.time()
        result = train_peer(opt, model, case, index, time.monotonic() + spec["timeout"])
        result.update(began=began, ready=ready, trained=time.time())
        (work / f"peer{index}.json").write_text(json.dumps(result))
        deadline = time.monotonic() + BARRIER_SECONDS
        while time.monotonic() < deadline and not all((work / f"peer{i}.json").exists() for i in range(PEERS)):
            time.sleep(0.2)
        time.sleep(2.0)  # partners may still be receiving the last round's parts from this peer
    finally:
        if opt is not None:
            opt.shutdown()
        dht.shutdown()


class Counters:
    """A peer's running totals, sampled with what its link has sent every ``COUNTER_PERIOD`` seconds by a thread (so
    that a step stuck for seconds shows as it goes): seconds computing (forward and backward) and inside
    ``opt.step``, samples trained."""

    def __init__(self) -> None:
        self.computing = self.stepping = 0.0
        self.trained = 0
        self.step_began: Optional[float] = None  # perf_counter() of the step under way
        self.series: list[list[float]] = []  # [unix time, bytes sent, computing, stepping, trained]
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(COUNTER_PERIOD):
            self.sample()

    def sample(self) -> None:
        began = self.step_began
        stepping = self.stepping + (time.perf_counter() - began if began is not None else 0.0)
        self.series.append([time.time(), tx_bytes(), self.computing, stepping, self.trained])

    def stop(self) -> list[list[float]]:
        self._stop.set()
        self.sample()
        return self.series


def train_peer(opt, model, case: Case, index: int, deadline: float) -> dict:
    """The training loop: a record per finished epoch (when, samples averaged in, the step that closed it), each
    round's outcome as the averager saw it, and the ``Counters`` series."""
    import torch

    train, held_out = splits()
    generator = torch.Generator().manual_seed(SEED + 100 + index)
    records, outcomes, counters, closing = [], {}, Counters(), {}
    while opt.local_epoch < case.epochs and time.monotonic() < deadline:
        began = time.perf_counter()
        loss_of(model, windows(train, BATCH, generator)).backward()
        computed, step_began = time.perf_counter(), time.time()
        counters.computing += computed - began
        counters.step_began = computed
        opt.step()
        opt.zero_grad()
        stepped = time.perf_counter()
        counters.step_began, counters.stepping = None, counters.stepping + stepped - computed
        counters.trained += BATCH
        for finished in opt.finished_epochs:  # the step that closed the epoch (its round may end later)
            closing.setdefault(finished.epoch, (step_began, stepped - computed))
        opt.collect_rounds()  # as the worker's loop does between mini-steps: an overlapped outer round may be over
        if opt.rounds_over:
            note_round(opt.averager, outcomes)
        record_rounds(opt, records, closing)
    series = counters.stop()
    # the last step's update (large-batch) or outer round (overlapped local updates) runs in the background
    opt.state_averager.step(wait_for_delayed_updates=True)
    opt.collect_rounds()
    record_rounds(opt, records, closing)
    note_round(opt.averager, outcomes)
    return dict(records=records, rounds=sorted(outcomes.values(), key=lambda r: r["began"]), series=series,
                epoch=opt.local_epoch, eval_loss=held_out_loss(model, held_out),
                missed_rounds=getattr(opt.state_averager, "missed_rounds", 0))


def record_rounds(opt, records: list, closing: dict) -> None:
    """A record per epoch whose round has ended: when (the round's end as the loop saw it), the samples it averaged
    in (known at its end where the round ran in the background), and the step that closed it (``closing``: epoch ->
    its start, seconds). Receipts: nobody credits here."""
    while opt.finished_epochs and opt.rounds_over:
        finished, receipts = opt.finished_epochs.pop(0), opt.rounds_over.pop(0)
        samples = receipts.samples if receipts.samples is not None else finished.samples
        step_began, closing_step = closing.get(finished.epoch, (time.time(), 0.0))
        records.append(dict(epoch=finished.epoch, samples=samples, time=time.time(), step_began=step_began,
                            closing_step=closing_step))


def note_round(averager, outcomes: dict) -> None:
    """The averager's last all-reduce, by its start (a background round is seen again, with more bytes, later)."""
    try:
        outcome = averager.last_round(timeout=5.0)
    except Exception:  # the averager is busy: the next look will see it
        return
    if outcome is not None:
        outcomes[outcome.began] = dict(began=outcome.began, seconds=outcome.seconds, sent=outcome.transfers.sent,
                                       received=outcome.transfers.received, complete=outcome.complete,
                                       group=len(outcome.peer_ids))


def tx_bytes() -> int:
    """Bytes this namespace's link has sent (the peer runs inside it)."""
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def wait_for(path: Path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.1)
    raise RuntimeError(f"{path} did not appear within {timeout:.0f} s")


# --- the bench ---------------------------------------------------------------------------------------------------


PATTERNS = {"local-updates": 1, "large-batch": TARGET_BATCH // (PEERS * BATCH)}  # mini-batches per AdamW step


def solo_rate(algorithm: str, seconds: float) -> float:
    """Samples/s of PEERS solo processes at once, summed, each stepping as a peer of ``algorithm`` does."""
    procs = [subprocess.Popen([sys.executable, "-m", "bench.local_updates", "solo", str(PATTERNS[algorithm]),
                               str(seconds)], stdout=subprocess.PIPE, text=True, start_new_session=True)
             for _ in range(PEERS)]
    try:
        return sum(float(proc.communicate(timeout=seconds + 120)[0].split()[-1]) for proc in procs)
    finally:
        stop_all(procs)


def link_rate(solo: float) -> float:
    """Mbit/s at which the bound for one fp16 gradient round of PEERS peers is RATIO times a step's compute."""
    step_seconds = TARGET_BATCH / solo
    return round_bound(2 * parameter_count(), 1.0) / (RATIO * step_seconds)


def round_bound(vector_bytes: float, mbit: float) -> float:
    """``app.planner.lower_bound_seconds`` for PEERS peers on symmetric links of ``mbit`` Mbit/s."""
    from app.planner import PeerProfile, lower_bound_seconds

    peers = [PeerProfile(f"p{i}", 1.0, mbit * MBIT, mbit * MBIT) for i in range(PEERS)]
    return lower_bound_seconds(peers, vector_bytes, hold_back=False)


def run_swarm(case: Case, mbit: float, timeout: float, logs: Path) -> list[dict]:
    """One swarm run of ``case`` on fresh namespaces; each peer's result (or an error)."""
    work = Path(tempfile.mkdtemp(prefix="dedloc-lu-"))
    try:
        run_peers(case, mbit, timeout, logs, work)
        results = []
        for i in range(PEERS):
            path = work / f"peer{i}.json"
            if path.exists():
                shutil.copy(path, logs / f"{case.name.replace(' ', '_')}-p{i}.json")
            results.append(json.loads(path.read_text()) if path.exists() else dict(error=f"peer {i} wrote no result"))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_peers(case: Case, mbit: float, timeout: float, logs: Path, work: Path) -> None:
    """Start the peers in their namespaces and wait until they are done (or one failed); remove all of it."""
    star, procs = Star([Link(mbit, mbit)] * PEERS, QUEUE_MS), []
    try:
        for i, ns in enumerate(star.peers):
            spec = dict(case=asdict(case), work=str(work), index=i, ip=star.ip(i), timeout=timeout)
            procs.append(spawn(["ip", "netns", "exec", ns, sys.executable, "-m", "bench.local_updates", "peer",
                                json.dumps(spec)], log=logs / f"{case.name.replace(' ', '_')}-p{i}.log",
                               env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, cwd=ROOT))
        deadline = time.monotonic() + timeout + BARRIER_SECONDS + 60.0
        while time.monotonic() < deadline and any(proc.poll() is None for proc in procs):
            if any(proc.poll() for proc in procs):  # a peer failed: its partner would wait for it to the timeout
                break
            time.sleep(0.5)
    finally:
        with signals_ignored():
            stop_all(procs)
            star.close()


def measure(case: Case, peers: list[dict], solo: float, mbit: float) -> dict:
    """The row of one run (``solo``: the solo sum for its step pattern, samples/s): the window's rates, bytes and
    round times, the final loss (``eval_samples``). A large-batch step's compute is TARGET_BATCH at ``solo``."""
    vector = 2 * parameter_count()  # an fp16 gradient or pseudo-gradient
    step_compute = TARGET_BATCH / solo
    row = dict(algorithm=case.algorithm, case=case.name, profile=f"{PEERS} peers, {mbit:.2f} Mbit/s each way",
               compression=case.compression, skipped_rounds=case.skip, peers=PEERS, batch_size=BATCH,
               target_batch=TARGET_BATCH,
               outer_batch=case.outer_batch, link_mbit=round(mbit, 3), parameters=parameter_count(),
               outer_lr=run_config(case).optimizer.outer_lr if case.outer_batch else None,
               outer_momentum=run_config(case).optimizer.outer_momentum if case.outer_batch else None,
               solo_samples_per_second=round(solo, 1),
               step_compute_seconds=round(step_compute, 4),
               round_bound_seconds=round(round_bound(vector, mbit), 4),
               bound_over_step_compute=round(round_bound(vector, mbit) / step_compute, 2))
    errors = [p["error"] for p in peers if "error" in p]
    if errors:
        return dict(row, error="; ".join(errors))
    by_epoch = [{r["epoch"]: r for r in p["records"]} for p in peers]
    closed: dict[int, float] = {}  # epoch -> when the swarm closed it (the last peer that took part)
    for peer in by_epoch:
        for epoch, record in peer.items():
            closed[epoch] = max(closed.get(epoch, 0.0), record["time"])
    epochs = sorted(closed)
    if len(epochs) < case.skip + 2:
        return dict(row, error=f"only {len(epochs)} rounds closed (epochs {epochs})")
    # The window runs from the swarm's closing of epoch ``first`` to its closing of the last. A peer that fell behind
    # and then took the swarm's state skipped epochs (no record): what it trained meanwhile reached no round
    first, last = epochs[case.skip - 1], epochs[-1]
    inside = [e for e in epochs if first < e <= last]
    started, ended = closed[first], closed[last]
    seconds = ended - started
    samples = sum(peer[e]["samples"] for peer in by_epoch for e in inside if e in peer)
    if not samples:
        return dict(row, error=f"no round averaged a sample in the window (epochs {first + 1}-{last})")
    sent, computing, stepping, trained = (sum(at(p["series"], ended)[k] - at(p["series"], started)[k] for p in peers)
                                          for k in (1, 2, 3, 4))
    rounds = [r for p in peers for r in p["rounds"] if started <= r["began"] <= ended]
    closing = sum(peer[e]["closing_step"] for peer in by_epoch for e in inside if e in peer) / PEERS  # per peer
    round_payload = [r["sent"] for r in rounds if r["complete"]]
    rate = samples / seconds
    row.update(
        samples=samples, seconds=round(seconds, 2), rounds=len(inside), swarm_samples_per_second=round(rate, 1),
        efficiency=round(rate / solo, 3),
        bytes_per_sample=round(sent / samples, 1),
        payload_bytes_per_sample=round(sum(round_payload) / samples, 1) if round_payload else None,
        samples_per_round=round(samples / len(inside)),
        # rounds (all-reduces) in the window with every peer and every part, as each peer's averager saw them
        full_rounds=sum(r["complete"] and r["group"] == PEERS for r in rounds) // PEERS,
        incomplete_rounds=sum(not r["complete"] for r in rounds),
        round_seconds=round(statistics.median(r["seconds"] for r in rounds), 3) if rounds else None,
        closing_step_seconds=round(statistics.median(peer[e]["closing_step"] for peer in by_epoch for e in inside
                                                     if e in peer), 3),
        computing_share=round(computing / (PEERS * seconds), 3), stepping_share=round(stepping / (PEERS * seconds), 3),
        lost_samples=max(0, round(trained - samples)),  # the counters are sampled: +-1 mini-batch per peer
        missed_rounds=sum(p["missed_rounds"] for p in peers),
        eval_samples=sum(r["samples"] for peer in by_epoch for r in peer.values()),
        eval_loss=round(statistics.mean(p["eval_loss"] for p in peers), 4),
        eval_loss_spread=round(max(p["eval_loss"] for p in peers) - min(p["eval_loss"] for p in peers), 5),
        startup_seconds=round(max(p["ready"] for p in peers) - min(p["began"] for p in peers), 1))
    if row["round_seconds"]:
        row["round_over_step_compute"] = round(row["round_seconds"] / step_compute, 2)
    if case.algorithm == "local-updates":  # outer rounds run inside the step that closes a phase (large-batch
        # rounds run in the background, and a step waits for one wherever it comes)
        waits, tails = foreground(peers, inside)
        row.update(
            closing_share=round(closing / seconds, 3),
            # the swarm's rate outside the steps that close a round, over the solo sum: what the inner phases reach
            between_rounds_efficiency=round(samples / (seconds - closing) / solo, 3),
            # seconds inside the other steps per second of forward and backward: hivemind's cost per mini-step
            step_overhead=round((stepping - PEERS * closing) / computing, 3),
            # what the closing step spent before its round began (matchmaking) and after it ended (the outer step)
            wait_before_round_seconds=round(statistics.median(waits), 3) if waits else None,
            after_round_seconds=round(statistics.median(tails), 3) if tails else None)
    return row


def foreground(peers: list[dict], epochs: list[int]) -> tuple[list[float], list[float]]:
    """For each round that ran inside the step closing one of ``epochs``: seconds from the step's start to the
    round's (matchmaking, waiting for the partner) and from the round's end to the step's (the outer step)."""
    waits, tails = [], []
    for peer in peers:
        for record in (r for r in peer["records"] if r["epoch"] in epochs):
            inside = [r for r in peer["rounds"] if record["step_began"] <= r["began"] <= record["time"]]
            if inside:
                waits.append(inside[0]["began"] - record["step_began"])
                tails.append(record["time"] - inside[0]["began"] - inside[0]["seconds"])
    return waits, tails


def at(series: list[list[float]], when: float) -> list[float]:
    """A ``Counters`` series at ``when``, interpolated between the samples around it (clamped at its ends)."""
    times = [sample[0] for sample in series]
    i = bisect.bisect_left(times, when)
    if i == 0 or i == len(series):
        return series[min(i, len(series) - 1)]
    (t0, *v0), (t1, *v1) = series[i - 1], series[i]
    share = (when - t0) / (t1 - t0) if t1 > t0 else 1.0
    return [when] + [a + (b - a) * share for a, b in zip(v0, v1)]


def add_baselines(rows: list[dict], logs: Path) -> None:
    """Each row's single-process losses at its own samples: per PEERS * BATCH and per TARGET_BATCH samples."""
    batches = {"baseline": PEERS * BATCH, "baseline_large_batch": TARGET_BATCH}
    checkpoints = [row["eval_samples"] for row in rows if "eval_samples" in row]
    if not checkpoints:
        return
    outs = {key: logs / f"{key}.json" for key in batches}
    procs = [spawn([sys.executable, "-m", "bench.local_updates", "baseline", str(batch), str(outs[key]),
                    *map(str, checkpoints)], log=logs / f"{key}.log") for key, batch in batches.items()]
    try:
        for proc in procs:
            proc.wait(timeout=1800)
    finally:
        stop_all(procs)
    losses = {key: {int(k): v for k, v in json.loads(out.read_text()).items()} for key, out in outs.items()}
    for row in rows:
        if "eval_samples" not in row:
            continue
        same = "baseline" if row["algorithm"] == "local-updates" else "baseline_large_batch"
        row["baseline_batch"] = batches[same]
        row["baseline_eval_loss"] = round(losses[same][row["eval_samples"]]["eval_loss"], 4)
        row["eval_gap"] = round(row["eval_loss"] / row["baseline_eval_loss"] - 1, 4)
        if row["algorithm"] == "local-updates":
            row["baseline_large_batch_eval_loss"] = round(
                losses["baseline_large_batch"][row["eval_samples"]]["eval_loss"], 4)


def markdown(rows: list[dict]) -> str:
    reference = next((r for r in rows if r["algorithm"] == "large-batch" and r.get("compression") == "fp16"
                      and "bytes_per_sample" in r), None)
    first = next((r for r in rows if "link_mbit" in r), {})
    lines = [
        "# Large-batch against local-updates on slow links",
        "",
        f"Written by `python -m bench.local_updates` (part of `make bench`). {PEERS} peers in network namespaces "
        f"(`tc tbf`, CUBIC, {first.get('link_mbit', 0):.2f} Mbit/s each way), the worker's optimizer code on "
        f"tiny-lm's transformer ({first.get('parameters', 0):,} parameters), mini-batches of {BATCH}, large-batch "
        f"step {TARGET_BATCH} samples. The link is set so that the bound for one fp16 gradient round "
        f"({first.get('round_bound_seconds', 0):.2f} s) is {first.get('bound_over_step_compute', 0):.1f}x the "
        f"compute of one step ({first.get('step_compute_seconds', 0):.3f} s at the solo rate). Solo: {PEERS} "
        "processes at once without hivemind, measured right before and after each run; efficiency is over their "
        "mean. No coordinator or portal ran; other work shared the cores (the bench runs under the CPU lock). Method: "
        "docs/benchmarks.md#local-updates.",
        "",
        "| case | outer batch | outer momentum | compression | solo before / after | efficiency | bytes / sample "
        "| vs large-batch | payload / sample | round s | round / step compute | wait before round | time in step "
        "| samples | eval loss | single process | gap | single process, batch 256 |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r.get('case', 'all')} | | | {r.get('error') or r.get('skipped')} |")
            continue
        fewer = "-" if reference in (None, r) else f"{reference['bytes_per_sample'] / r['bytes_per_sample']:.1f}x fewer"
        lines.append(
            f"| {r['case']} | {r['outer_batch'] or '-'} | {_number(r['outer_momentum'], 'g')} | {r['compression']} | "
            f"{r['solo_before']:.0f} / {r['solo_after']:.0f} | "
            f"{r['efficiency']:.2f} | "
            f"{r['bytes_per_sample']:,.0f} | {fewer} | {_number(r['payload_bytes_per_sample'])} | "
            f"{_number(r['round_seconds'], '.2f')} | {_number(r.get('round_over_step_compute'), '.1f')} | "
            f"{_number(r.get('wait_before_round_seconds'), '.2f')} | "
            f"{r['stepping_share']:.0%} | {r['eval_samples']:,} | {r['eval_loss']:.3f} | "
            f"{_number(r.get('baseline_eval_loss'), '.3f')} (batch {r.get('baseline_batch', '-')}) | "
            f"{_number(r.get('eval_gap'), '+.1%')} | {_number(r.get('baseline_large_batch_eval_loss'), '.3f')} |")
    lines += ["", "Efficiency: swarm samples/s over the window (from the end of the first rounds, "
              "`skipped_rounds` in the JSON, to the end of the last) over the solo sum. Bytes: "
              "what both peers' links sent over the window (everything) per sample averaged in; payload: the "
              "averagers' own count of tensor bytes sent. Time in step: the share of the peers' wall time inside "
              "`opt.step()` (rounds, matchmaking, waiting for the partner). Eval loss: held-out loss after the last "
              "round, against one process that trained as many samples with one step per batch shown."]
    return "\n".join(lines) + "\n"


def _number(value, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "solo":
        solo_main(int(argv[1]), float(argv[2]))
        return 0
    if argv and argv[0] == "baseline":
        baseline_main(int(argv[1]), [int(x) for x in argv[3:]], Path(argv[2]))
        return 0
    if argv and argv[0] == "peer":
        try:
            peer_main(json.loads(argv[1]))
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # hivemind's threads would hold a failed peer (and the bench) until the run's timeout
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.local_updates", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two short runs (about two minutes), for a smoke test")
    parser.add_argument("--out", type=Path, default=RESULTS / "local_updates.json")
    parser.add_argument("--logs", type=Path, help="keep the peers' logs here (default: removed unless a run failed)")
    parser.add_argument("--case", action="append", choices=[case.name for case in CASES],
                        help="run only this case (repeatable; default: all)")
    args = parser.parse_args(argv)

    reason = namespaces_unavailable()
    if reason:
        print(f"local-updates bench skipped: {reason}")
        write_results(args.out, [dict(skipped=reason)], f"# Large-batch against local-updates\n\nskipped: {reason}\n")
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    logs = args.logs or Path(tempfile.mkdtemp(prefix="dedloc-lu-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    keep = bool(args.logs)
    try:
        cases = QUICK_CASES if args.quick else [case for case in CASES if not args.case or case.name in args.case]
        rows = run_all(cases, QUICK_SOLO_SECONDS if args.quick else SOLO_SECONDS, logs)
        keep = keep or any("error" in row for row in rows)  # a run that failed says so in its row: its logs stay
    except KeyboardInterrupt:
        print("interrupted: the namespaces and processes of this run are removed")
        return 130
    finally:
        if keep:
            print(f"logs in {logs}")
        else:
            shutil.rmtree(logs, ignore_errors=True)
    write_results(args.out, rows, markdown(rows))
    return 0


def run_all(cases: list[Case], solo_seconds: float, logs: Path) -> list[dict]:
    """Each case between two solo measurements of its own step pattern, then the single-process baselines."""
    started = time.monotonic()
    solo = solo_rate("large-batch", solo_seconds)
    mbit = link_rate(solo)
    print(f"solo (large-batch steps): {solo:.0f} samples/s; links {mbit:.2f} Mbit/s", flush=True)
    rows, previous = [], ("large-batch", solo)  # the last solo measurement: (step pattern, rate)
    for case in cases:
        before = previous[1] if previous[0] == case.algorithm else solo_rate(case.algorithm, solo_seconds)
        began = time.monotonic()
        timeout = 60.0 + case.epochs * ((case.outer_batch or TARGET_BATCH) / before * 1.5 + 10.0)
        peers = run_swarm(case, mbit, timeout, logs)
        wall = time.monotonic() - began
        after = solo_rate(case.algorithm, solo_seconds)
        previous = (case.algorithm, after)
        rows.append(dict(measure(case, peers, (before + after) / 2, mbit=mbit),
                         wall_seconds=round(wall, 1), solo_before=round(before, 1), solo_after=round(after, 1)))
        print(json.dumps(rows[-1]), flush=True)
    add_baselines(rows, logs)
    print(f"bench took {time.monotonic() - started:.0f} s", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
