"""Volunteers coming and going for a while: a seeded schedule of joins, Ctrl-C leaves, SIGKILLs, coordinator and
portal restarts, 30-second link drops and a ban, on a real portal, coordinator and tiny-lm workers, each worker on a
host of its own in network namespaces (``bench.netns``: mixed emulated links, every other one behind a NAT router),
then a checker that reads the history (docs/benchmarks.md#soak).

    python -m bench.soak [--minutes 30] [--seed 1] [--algorithm large-batch|local-updates] [--workers 6]
                         [--network emulated|loopback]

The schedule (``schedule``) draws an event every ``EVENT_SECONDS`` on average from the seed, keeping at least
``MIN_RUNNING`` workers training; the run's founder starts first and the others join once it trains. The founder
stays to the end (no leave, kill, link drop or ban), so one worker's series spans the run. A sampler
records each long-lived process tree's RSS, open files and threads every ``SAMPLE_SECONDS``. At the end every worker
leaves with Ctrl-C, the coordinator settles what they published, and the checker (``check``) reads the database, the
logs and the sampler's series. A watcher (``watch``) reads the workers' terminal lines as they come, so the longest
stall is what the volunteers saw, also while the coordinator is down. Each run appends one row to
``bench/results/soak.json`` (and the table in ``soak.md``); the row says what the checker counted, not whether it is
good: the bounds are in docs/architecture.md#outages and the note.

Viewers (``view``) read the dashboard and the public API all along, as the run's audience would: the row counts their
requests, answers of 500 or more, requests the portal did not answer while it was up, and the 95th percentile of the
answered ones' latency.

Without root (or iproute2 and nftables) the run says so and uses loopback, with no link drops (``--network``).

Peer tokens live ``TOKEN_LIFETIME`` seconds here, and a run of ten minutes or more has one long portal outage
(``LONG_OUTAGE_SECONDS``) in which the tokens of the workers that renewed longest ago expire: they hold their
training and train again once the portal is back (docs/architecture.md#outages).

``tests/test_soak.py`` runs a 5-minute variant on loopback (``make test-soak``; not yet in ``make test``, which it would
take past 20 minutes) and asserts the counts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import httpx
import psutil
from dedloc_common.contract import LOOPBACK_OPTIMIZER

from app.core.processes import kill_group, spawn, stop_all
from bench import netns, write_results

RESULTS = Path("bench/results")
EVENT_SECONDS = 40.0  # mean time between two scheduled events
MIN_RUNNING = 2  # a leave or kill never takes the swarm below this many training workers
SAMPLE_SECONDS = 60.0  # the issue's: every minute (a run under 10 minutes samples every 10 s)
WARM_UP_SHARE = 0.25  # growth is fitted after this share of the run
BAN_BOUND_SECONDS = 60.0  # docs/architecture.md: a ban reaches a running peer within 30 s; a round's claim after it
SETTLE_SECONDS = 45.0  # the coordinator's time to settle the last claims after the workers left
BATCH = 16
# Samples per step: about 2 s of the swarm's compute on loopback; on the emulated links 8 s, as the README advises a
# run to take several seconds a step (a 4-minute trial at 2 s steps: 88% of the samples in rounds that did not form or
# finish, the DSL uplinks and the NAT'd peers' first minutes)
TARGET_BATCH = {"loopback": 1024, "emulated": 4096}
# Matchmaking and the round's timeout: loopback's short ones; on the emulated links a run's default matchmaking (5 s),
# as a NAT'd peer's requests go through a relay (at 1 s, seed 6's 30 minutes left 42% of the samples unconfirmed,
# mostly "no averaging group formed" on the client-mode peers)
MATCHMAKING = {"loopback": {"matchmaking_time": 1.0, "averaging_timeout": 10.0},
               "emulated": {"matchmaking_time": 5.0, "averaging_timeout": 30.0}}
# (event, weight): what the schedule draws from; link drops only where the workers have links of their own
EVENTS = (("join", 4), ("leave", 2), ("kill", 2), ("restart-coordinator", 1), ("restart-portal", 1), ("link-drop", 2))
LINK_DROP_SECONDS = 30.0
# Tokens are renewed at half-life, so at an outage's start each is 0-60 s old and expires 60-120 s later: a 90 s
# outage outlives about half of them
TOKEN_LIFETIME, LONG_OUTAGE_SECONDS = 120.0, 90.0
OUTAGE_RUN_SECONDS = 600.0  # runs this long or longer have the long outage
EXPIRED_LINE = "token expired and the portal cannot renew it"  # dedloc_worker.admission.keeper's line
# Volunteers' access links, Mbit/s down and up, given in turn: fibre, cable, DSL. The even-numbered workers are open
# hosts, the odd-numbered ones sit behind a home router (NAT) and become client-mode peers by themselves.
LINKS = (netns.Link(down=100, up=100), netns.Link(down=50, up=10), netns.Link(down=16, up=2))
TRACEBACK = "Traceback (most recent call last)"
UNCONFIRMED = "not confirmed"  # how app.credit.decision words a claim no other volunteer's peer saw
PARTS = ("main", "p2pd", "children")  # what a process tree's RSS is split into (``part_of``)
VIEW_SECONDS = 1.0  # between two viewers' requests
WATCH_SECONDS = 1.0  # between two reads of the workers' terminal lines
EPOCH_LINE = re.compile(r"^epoch (\d+) \|", re.MULTILINE)  # a worker's line per epoch (dedloc_worker.terminal)
# what a run's audience reads: the dashboard and what its script polls, the public API
VIEWED = ("/runs/soak", "/api/v1/runs/soak/swarm", "/api/v1/runs/soak/progress", "/api/v1/runs/soak/history",
          "/api/v1/runs/soak/plan", "/api/v1/runs/soak/leaderboard", "/api/v1/runs/soak/status", "/runs/soak/join")


@dataclass
class Soak:
    """The processes of one soak run, its schedule's record and the sampler's series."""

    work: Path
    url: str
    env: dict
    workers: int
    portal: Optional[subprocess.Popen] = None
    coordinator: Optional[subprocess.Popen] = None
    running: dict = field(default_factory=dict)  # username -> Popen
    done: list = field(default_factory=list)  # (username, Popen) of workers that left or were killed
    events: list = field(default_factory=list)  # {"at": unix time, "event": ..., "user": ...}
    samples: list = field(default_factory=list)  # {"at", "process", "rss", "fds", "threads"}
    banned: Optional[str] = None
    banned_at: Optional[float] = None
    views: list = field(default_factory=list)  # {"at", "path", "status" (None: no answer), "ms"}
    progress: list = field(default_factory=list)  # (unix time, the newest epoch any worker's terminal showed)
    epochs_seen: dict = field(default_factory=dict)  # session -> [(unix time, epoch its terminal showed)]
    sessions: dict = field(default_factory=dict)  # username -> its running session's log name ("user" or "user.N")
    internet: Optional[netns.Internet] = None  # the workers' hosts; None on loopback
    timings: dict = field(default_factory=dict)  # the run's matchmaking_time and averaging_timeout
    links_down: dict = field(default_factory=dict)  # username -> threading.Timer that brings its link back

    def log(self, name: str) -> Path:
        return self.work / "logs" / f"{name}.log"

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "app.cli", *args], env={**os.environ, **self.env},
                              capture_output=True, text=True, timeout=120)

    def start_portal(self) -> None:
        self.portal = spawn([sys.executable, "-m", "app.cli", "serve"], log=self.log("portal"), env=self.env)

    def start_coordinator(self) -> None:
        self.coordinator = spawn([sys.executable, "-m", "app.cli", "coordinator", "--run", "soak"],
                                 log=self.log("coordinator"), env=self.env)

    def start_worker(self, user: str) -> None:
        credential = self.cli("issue-credential", user).stdout.strip()
        count = sum(1 for name, _ in self.done if name == user)  # a worker's later sessions log apart
        name = user if not count else f"{user}.{count}"
        self.sessions[user] = name
        # on its own host where there is an emulated internet, listening on its addresses there
        where = ["ip", "netns", "exec", self.internet.ns(user)] if self.internet else []
        listen = "/ip4/0.0.0.0/tcp/0" if self.internet else "/ip4/127.0.0.1/tcp/0"
        self.running[user] = spawn(
            [*where, sys.executable, "-m", "dedloc_worker", "join", self.url, "--run", "soak", "--threads", "1",
             "--listen", listen, "--report", str(self.work / f"{name}.json")],
            log=self.log(name), env={**self.env, "DEDLOC_WORKER_CREDENTIAL": credential})

    def drop_link(self, user: str) -> None:
        """Pull ``user``'s cable for ``LINK_DROP_SECONDS``; a timer plugs it back in (the schedule goes on)."""
        assert self.internet is not None
        self.internet.link(user, False)
        self.note("link down", user)
        timer = threading.Timer(LINK_DROP_SECONDS, self.restore_link, args=(user,))
        self.links_down[user] = timer
        timer.start()

    def restore_link(self, user: str) -> None:
        if self.links_down.pop(user, None) is not None and self.internet is not None:
            self.internet.link(user, True)
            self.note("link up", user)
            self.events[-1]["session"] = self.sessions.get(user, user)

    def stop_worker(self, user: str, sig: int) -> None:
        """Ctrl-C (SIGINT: the worker leaves within its grace), or SIGKILL to its whole process group at once (its
        DHT daemon and averagers too: a machine that lost power)."""
        proc = self.running.pop(user)
        if sig == signal.SIGINT:
            stop_all([proc], grace=30, sig=sig)
        else:
            kill_group(proc.pid)
        proc.wait(30)
        self.done.append((user, proc))

    def note(self, event: str, user: str = "") -> None:
        self.events.append(dict(at=time.time(), event=event, user=user))
        print(f"{time.strftime('%H:%M:%S')} {event} {user}".rstrip(), flush=True)


def schedule(seed: int, seconds: float) -> list[tuple[float, str]]:
    """(seconds from the start, event) drawn from ``seed``: exponential gaps of mean ``EVENT_SECONDS``, one ban at
    about the middle. A run of ``OUTAGE_RUN_SECONDS`` or more has its long portal outage at a quarter of the run and
    no portal restart after it: the portal that comes back lives three quarters of the run, long enough for its RSS
    to be fitted past its own warm-up (restarts every few minutes left no instance that did)."""
    rng, at, events = random.Random(seed), 0.0, []
    kinds, weights = zip(*EVENTS)
    outage_at = seconds / 4 if seconds >= OUTAGE_RUN_SECONDS else None
    while True:
        at += rng.expovariate(1 / EVENT_SECONDS)
        if at >= seconds - 60:  # the last minute runs undisturbed before the workers leave
            break
        event = rng.choices(kinds, weights)[0]
        if not (event == "restart-portal" and outage_at is not None and at >= outage_at):
            events.append((at, event))
    events.append((seconds / 2, "ban"))
    if outage_at is not None:
        events.append((outage_at, "portal-outage"))
    return sorted(events)


def apply(soak: Soak, event: str, rng: random.Random, users: list[str]) -> None:
    idle = [u for u in users if u not in soak.running and u != soak.banned]
    live = [u for u in soak.running if u != soak.banned]
    # the founder stays the whole run, as an organizer's own machine would: one worker whose RSS spans the run
    movable = [u for u in live if u != users[0]]
    if event == "join" and idle:
        user = rng.choice(idle)
        soak.start_worker(user)
        soak.note("join", user)
    elif event in ("leave", "kill") and len(live) > MIN_RUNNING and movable:
        user = rng.choice(movable)
        soak.stop_worker(user, signal.SIGINT if event == "leave" else signal.SIGKILL)
        soak.note(event, user)
    elif event.startswith("restart-"):  # the coordinator or the portal, down for 5 s
        server = event.removeprefix("restart-")
        stop_all([getattr(soak, server)], grace=10)
        soak.note(f"{server} down")
        time.sleep(5)
        getattr(soak, f"start_{server}")()
        soak.note(f"{server} up")
    elif event == "portal-outage":  # past some workers' tokens' expiry
        stop_all([soak.portal], grace=10)
        soak.note("portal down", "long")
        time.sleep(LONG_OUTAGE_SECONDS)
        soak.start_portal()
        soak.note("portal up", "long")
        time.sleep(15)  # the holders' next try (10 s) before any overdue event can make one leave
    elif event == "link-drop" and soak.internet is not None:
        up = [u for u in movable if u not in soak.links_down]
        if up:
            soak.drop_link(rng.choice(up))
    elif event == "ban" and movable:
        user = rng.choice(movable)
        result = soak.cli("ban", "soak", user, "--reason", "soak bench")
        if result.returncode == 0:
            soak.banned, soak.banned_at = user, time.time()
            soak.note("ban", user)


def view(soak: Soak, stop: threading.Event) -> None:
    """Read the dashboard and the public API in turn until ``stop``, one request every ``VIEW_SECONDS``."""
    with httpx.Client(base_url=soak.url, timeout=10) as client:
        for index in itertools.count():
            if stop.wait(VIEW_SECONDS):
                return
            path, began = VIEWED[index % len(VIEWED)], time.perf_counter()
            try:
                status: Optional[int] = client.get(path).status_code
            except httpx.HTTPError:
                status = None
            soak.views.append(dict(at=time.time(), path=path, status=status, ms=(time.perf_counter() - began) * 1000))


def watch(soak: Soak, stop: threading.Event) -> None:
    """Until ``stop``, read what the workers printed since the last read and note the newest epoch any of them
    reached: training's progress as the volunteers see it, also while the coordinator (whose snapshots the database
    holds) is down."""
    offsets: dict[Path, int] = {}
    while not stop.wait(WATCH_SECONDS):
        newest, now = None, time.time()
        for log in sorted((soak.work / "logs").glob("volunteer*.log")):
            with log.open("rb") as handle:
                handle.seek(offsets.get(log, 0))
                text = handle.read().decode(errors="replace")
                offsets[log] = handle.tell()
            for found in EPOCH_LINE.finditer(text):
                newest = max(newest or 0, int(found.group(1)))
                soak.epochs_seen.setdefault(log.stem, []).append((now, int(found.group(1))))
        if newest is not None:
            soak.progress.append((now, newest))


def sample(soak: Soak) -> None:
    """RSS, open files and threads of each long-lived process tree (its children: p2pd, averagers)."""
    trees = {"portal": soak.portal, "coordinator": soak.coordinator,
             **{f"worker {user}": proc for user, proc in soak.running.items()}}
    now = time.time()
    for name, proc in trees.items():
        if proc is None or proc.poll() is not None:
            continue
        try:
            root = psutil.Process(proc.pid)
            members = [root, *root.children(recursive=True)]
            rss = fds = threads = 0
            parts = dict.fromkeys(PARTS, 0)
            for member in members:
                try:
                    size = member.memory_info().rss
                    rss += size
                    parts[part_of(member, root)] += size
                    fds += member.num_fds()
                    threads += member.num_threads()
                except psutil.NoSuchProcess:
                    continue
        except psutil.NoSuchProcess:
            continue
        soak.samples.append(dict(at=now, process=name, pid=proc.pid, rss=rss, fds=fds, threads=threads, parts=parts))


def part_of(member: psutil.Process, root: psutil.Process) -> str:
    """Which part of a process tree ``member`` is: the process itself, libp2p's daemon, or another child (a worker's
    DHT and averager processes, a portal's web processes)."""
    if member.pid == root.pid:
        return "main"
    return "p2pd" if member.name() == "p2pd" else "children"


def rss_growth_by_part(samples: list, began: float, seconds: float) -> dict:
    """``rss_growth`` of each part (``part_of``) of each process tree, where the tree has that part: what grows."""
    split = [dict(sampled, process=f"{sampled['process']}: {part}", rss=size)
             for sampled in samples for part, size in sampled.get("parts", {}).items() if size]
    return rss_growth(split, began, seconds)


def run(minutes: float, seed: int, algorithm: str, workers: int, keep: Optional[Path], emulated: bool) -> dict:
    seconds = minutes * 60
    work = Path(tempfile.mkdtemp(prefix="dedloc-soak-"))
    (work / "logs").mkdir()
    port = _free_port()
    users = [f"volunteer{i}" for i in range(workers)]
    # the portal and the coordinator on this machine's leg of the emulated internet, where the hosts reach them
    host, network = (netns.SERVER, "emulated") if emulated else ("127.0.0.1", "loopback")
    env = {"DEDLOC_DATA_DIR": str(work / "var"), "DEDLOC_PORT": str(port), "DATABASE_URL": "", "DEDLOC_HOST": host,
           "DEDLOC_PEER_TOKEN_LIFETIME": str(TOKEN_LIFETIME)}
    soak = Soak(work=work, url=f"http://{host}:{port}", env=env, workers=workers)
    optimizer = {**LOOPBACK_OPTIMIZER, **MATCHMAKING[network], "metadata_expiration": 10.0,
                 "next_chunk_timeout": 3.0, "algorithm": algorithm}
    soak.timings = MATCHMAKING[network]
    if algorithm == "local-updates":
        optimizer["outer_batch_size"] = 4 * TARGET_BATCH[network]
    created = soak.cli("create-run", "soak", "--task", "tiny-lm", "--target-batch-size", str(TARGET_BATCH[network]),
                       "--batch-size", str(BATCH), "--optimizer", json.dumps(optimizer),
                       "--checkpoints", json.dumps({"every_epochs": 10**6, "spot_check_rate": 0.0}))
    if created.returncode != 0:
        raise SystemExit(f"create-run failed: {created.stderr.strip()}")
    rng = random.Random(seed + 1)
    stop_sampling = threading.Event()
    period = SAMPLE_SECONDS if minutes >= 10 else 10.0
    sampler = threading.Thread(target=lambda: [sample(soak) for _ in iter(lambda: stop_sampling.wait(period), True)],
                               daemon=True)
    viewer = threading.Thread(target=view, args=(soak, stop_sampling), daemon=True)
    watcher = threading.Thread(target=watch, args=(soak, stop_sampling), daemon=True)
    began = time.time()
    try:
        if emulated:
            soak.internet = netns.Internet(open_hosts=users[0::2], home_hosts=users[1::2],
                                           links={user: LINKS[i % len(LINKS)] for i, user in enumerate(users)})
        soak.start_portal()
        soak.start_coordinator()
        _wait(lambda: httpx.get(f"{soak.url}/api/v1/runs/soak/join").json()["initial_peers"], 90)
        soak.start_worker(users[0])
        soak.note("join", users[0])
        _wait(lambda: httpx.get(f"{soak.url}/api/v1/runs/soak/swarm").json()["epoch"] >= 1, 180)
        for user in users[1:workers // 2 + 1]:
            soak.start_worker(user)
            soak.note("join", user)
        sampler.start()
        viewer.start()
        watcher.start()
        sample(soak)
        for at, event in schedule(seed, seconds):
            time.sleep(max(0.0, began + at - time.time()))
            apply(soak, event, rng, users)
        time.sleep(max(0.0, began + seconds - time.time()))
        for user, timer in list(soak.links_down.items()):  # every link back before the workers leave
            timer.cancel()
            soak.restore_link(user)
        for user in list(soak.running):
            soak.stop_worker(user, signal.SIGINT)
            soak.note("leave", user)
        stop_sampling.set()
        time.sleep(SETTLE_SECONDS)
        row = check(soak, began, minutes, seed, algorithm)
        return row
    finally:
        stop_sampling.set()
        for timer in list(soak.links_down.values()):
            timer.cancel()
        stop_all(list(soak.running.values()))
        stop_all([p for p in (soak.coordinator, soak.portal) if p is not None])
        if soak.internet is not None:
            soak.internet.close()
        if keep:
            shutil.copytree(work, keep, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)


def check(soak: Soak, began: float, minutes: float, seed: int, algorithm: str) -> dict:
    """What the history says: the checker reads the database, every log and the sampler's series."""
    from sqlalchemy import func, select

    from app.core.database import make_engine, make_sessionmaker
    from app.credit.ledger import users_of_peer_ids
    from app.models import Base, Contribution, Peer, Run, Snapshot

    engine = make_engine(f"sqlite:///{soak.work / 'var' / 'dedloc.sqlite3'}")
    try:
        with make_sessionmaker(engine)() as session:
            claims = session.execute(select(Contribution.username, Contribution.peer_key, Contribution.epoch,
                                            Contribution.samples, Contribution.credited, Contribution.held,
                                            Contribution.reason, Contribution.recorded_at,
                                            Contribution.members)).all()
            run = session.scalar(select(Run).where(Run.slug == "soak"))
            owners = users_of_peer_ids(session, run, {m for c in claims for m in (c.members or ())}) if run else {}
            clients = {name for name, reachability in session.execute(select(Peer.username, Peer.reachability))
                       if reachability == "unreachable"}
            snapshots = session.execute(select(Snapshot.taken_at, Snapshot.epoch).order_by(Snapshot.taken_at)).all()
            rows = {table.name: session.scalar(select(func.count()).select_from(table))
                    for table in Base.metadata.sorted_tables}
    finally:
        engine.dispose()

    honest = [c for c in claims if c.username != soak.banned and c.samples > 0]
    held = [c for c in honest if c.held > 0]
    # samples no other volunteer averaged (no round, a round alone or unfinished): work lost, not credit withheld
    unconfirmed = [c for c in held if (c.reason or "").startswith(UNCONFIRMED)]
    withheld = [c for c in held if c not in unconfirmed]  # averaged with others, yet held: disputes, the ceiling
    # a round whose other members were all client-mode peers: they aggregate no part, so nobody can confirm the claim
    only_clients = [c for c in unconfirmed
                    if (others := {owners.get(m) for m in c.members or ()} - {c.username, None}) and others <= clients]
    reasons: dict[str, int] = {}
    for c in held:
        key = re.sub(r"\d[\d,.]*", "N", c.reason or "")[:90]  # numbers out: one key per kind of reason
        reasons[key] = reasons.get(key, 0) + 1
    per_epoch: dict[tuple, int] = {}
    for c in claims:
        per_epoch[c.peer_key, c.epoch] = per_epoch.get((c.peer_key, c.epoch), 0) + 1
    double = sum(1 for count in per_epoch.values() if count > 1) + sum(1 for c in claims if c.credited > c.samples)
    banned_after = [c for c in claims if soak.banned and c.username == soak.banned and c.credited > 0
                    and _unix(c.recorded_at) > (soak.banned_at or 0) + BAN_BOUND_SECONDS]

    # from a link's return to the first epoch its worker's terminal showed after it that was credited
    credited: dict[str, set] = {}
    for c in claims:
        if c.credited > 0:
            credited.setdefault(c.username, set()).add(c.epoch)
    recoveries = []
    for back in (e for e in soak.events if e["event"] == "link up"):
        seen = [t for t, epoch in soak.epochs_seen.get(back.get("session", back["user"]), [])
                if t >= back["at"] and epoch in credited.get(back["user"], ())]
        recoveries.append(round(seen[0] - back["at"], 1) if seen else None)

    stall, stall_at = longest_stall(soak.progress)
    snapshot_gap, _ = longest_stall([(_unix(taken_at), epoch) for taken_at, epoch in snapshots])
    stall_cause = _nearest_event(soak.events, stall_at) if stall_at is not None else None

    logs = sorted((soak.work / "logs").glob("*.log"))
    texts = {log.stem: log.read_text(errors="replace") for log in logs}
    tracebacks = {name: text.count(TRACEBACK) for name, text in texts.items()}
    # workers whose token expired in a portal outage, and those of them that never trained again (nor left)
    expired = {name: text for name, text in texts.items() if EXPIRED_LINE in text}
    never_resumed = sorted(name for name, text in expired.items()
                           if "training resumes" not in text[text.rindex(EXPIRED_LINE):])
    growth = rss_growth(soak.samples, began, minutes * 60)
    answered = sorted(v["ms"] for v in soak.views if v["status"] is not None)
    restarts = restart_windows(soak.events, soak.views)
    # the raw series, for a second look at a kept run (--keep copies the folder)
    (soak.work / "series.json").write_text(json.dumps(dict(events=soak.events, samples=soak.samples, views=soak.views,
                                                           progress=soak.progress, epochs_seen=soak.epochs_seen)))
    return dict(
        seed=seed, minutes=minutes, algorithm=algorithm, workers=soak.workers,
        network=(f"emulated: {len(soak.internet.open_hosts)} open hosts, {len(soak.internet.home_hosts)} behind NAT, "
                 "links " + ", ".join(f"{link.down:g}/{link.up:g}" for link in LINKS) + " Mbit/s"
                 if soak.internet else "loopback"),
        matchmaking_seconds=soak.timings["matchmaking_time"], averaging_timeout=soak.timings["averaging_timeout"],
        events={kind: sum(1 for e in soak.events if e["event"] == kind) for kind in
                ("join", "leave", "kill", "coordinator down", "portal down", "ban", "link down")},
        # None: the worker left or was killed before an epoch of its was credited again
        link_recovery_seconds=recoveries,
        tokens_expired=len(expired), expired_never_resumed=never_resumed,
        epochs=max((epoch for _, epoch in snapshots), default=0),
        honest_claims=len(honest), uncredited_epochs=len(withheld), unconfirmed_epochs=len(unconfirmed),
        uncredited_reasons=reasons,
        uncredited_samples_share=round(sum(c.held for c in withheld) / max(1, sum(c.samples for c in honest)), 4),
        unconfirmed_samples_share=round(sum(c.held for c in unconfirmed) / max(1, sum(c.samples for c in honest)), 4),
        unconfirmed_only_client_partners=len(only_clients),
        double_credited_epochs=double, banned_credit_past_bound=len(banned_after),
        # the control: the banned user trained and was credited before the ban
        banned_credited_before=sum(1 for c in claims if soak.banned and c.username == soak.banned and c.credited > 0
                                   and _unix(c.recorded_at) <= (soak.banned_at or 0)),
        tracebacks=sum(tracebacks.values()), tracebacks_by_log={k: v for k, v in tracebacks.items() if v},
        longest_stall_seconds=round(stall, 1), longest_stall_near=stall_cause,
        longest_snapshot_gap_seconds=round(snapshot_gap, 1),
        rss_growth_per_hour=growth,
        rss_growth_per_hour_by_part=rss_growth_by_part(soak.samples, began, minutes * 60),
        fds_last={name: series[-1]["fds"] for name, series in _series(soak.samples).items()},
        threads_last={name: series[-1]["threads"] for name, series in _series(soak.samples).items()},
        viewer_requests=len(soak.views),
        viewer_errors=sum(1 for v in soak.views if v["status"] is not None and v["status"] >= 500),
        viewer_unanswered=sum(1 for v in soak.views if v["status"] is None
                              and not any(start <= v["at"] <= end for start, end in restarts)),
        viewer_p95_ms=round(answered[int(0.95 * (len(answered) - 1))]) if answered else None,
        viewer_errors_by_path={path: n for path in VIEWED if (n := sum(
            1 for v in soak.views if v["path"] == path and (v["status"] or 0) >= 500))},
        rows=rows,
    )


def longest_stall(progress: list) -> tuple[float, Optional[float]]:
    """(the longest time between two increases of the epoch in ``progress``, (time, epoch) in time order; when
    that stretch began), (0, None) with fewer than two increases."""
    stall, stall_at = 0.0, None
    last_change: Optional[tuple[float, int]] = None
    for when, epoch in progress:
        if last_change is None or epoch > last_change[1]:
            if last_change is not None and when - last_change[0] > stall:
                stall, stall_at = when - last_change[0], last_change[0]
            last_change = (when, epoch)
    return stall, stall_at


def rss_growth(samples: list, began: float, seconds: float) -> dict:
    """Per process tree: the slope of its RSS after the warm-up (least squares), per hour, over its mean RSS there,
    for its longest-lived process after the warm-up (a restarted portal or coordinator starts small again: across a
    restart the slope is start-up, not a leak); None with fewer than three samples or spanning less than the
    warm-up (a worker that came and went).
    Each process's own warm-up is left out too (a portal restarted at minute 10 warms up until about 17): fitted
    with it, a restarted portal's start-up read as +42% to +110% an hour."""
    warm_up = WARM_UP_SHARE * seconds
    started: dict[int, float] = {}
    for sampled in samples:
        pid = sampled.get("pid", 0)
        started[pid] = min(started.get(pid, sampled["at"]), sampled["at"])
    growth = {}
    for name, series in _series(samples).items():
        instances: dict[int, list] = {}
        for sampled in series:
            pid = sampled.get("pid", 0)
            if sampled["at"] >= max(began, started[pid]) + warm_up:
                instances.setdefault(pid, []).append((sampled["at"], sampled["rss"]))
        points = max(instances.values(), key=len, default=[])
        # at least three samples over at least a warm-up's length: a process whose fit spanned 2 minutes read its
        # 7 MB of noise as +16% an hour (seed 9's volunteer4)
        if len(points) < 3 or points[-1][0] - points[0][0] < warm_up:
            growth[name] = None
            continue
        slope = statistics.linear_regression([t for t, _ in points], [r for _, r in points]).slope
        growth[name] = round(slope * 3600 / statistics.mean(r for _, r in points), 4)
    return growth


def restart_windows(events: list, views: list) -> list[tuple[float, float]]:
    """(from, to) unix times of each scheduled portal restart: from its stop to the first answer a viewer got after it
    started again (a minute after that start if none came)."""
    windows = []
    for down in (e for e in events if e["event"] == "portal down"):
        up = next((e["at"] for e in events if e["event"] == "portal up" and e["at"] >= down["at"]), down["at"])
        answered = next((v["at"] for v in views if v["at"] > up and v["status"] is not None), up + 60.0)
        windows.append((down["at"], answered))
    return windows


def _series(samples: list) -> dict:
    series: dict[str, list] = {}
    for s in samples:
        series.setdefault(s["process"], []).append(s)
    return series


def _nearest_event(events: list, when: float) -> Optional[str]:
    before = [e for e in events if e["at"] <= when + 5]
    return f"{before[-1]['event']} {before[-1]['user']}".strip() if before else None


def _unix(value: datetime) -> float:
    return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()


def _wait(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"not ready within {timeout:.0f} s")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def markdown(rows: list) -> str:
    lines = ["# Soak: volunteers coming and going", "",
             "Written by `python -m bench.soak` (method: docs/benchmarks.md#soak). One row per run; loopback, tiny-lm.",
             "Uncredited: honest claims other volunteers averaged with, yet held (disputes, the ceiling); unconfirmed:"
             " claims no other volunteer averaged (no round formed, or it did not finish), whose samples entered no "
             "shared step. Rows before 2026-12-07 06:00 counted both as uncredited. Longest stall: the longest time "
             "between two new epochs in the workers' terminal lines, and the event nearest its start (rows before "
             "2026-12-07 13:00: in the coordinator's snapshots, which stop while it is down; later rows give that as "
             "\"snapshots\").",
             "Network: where a row names none, loopback. Link back: seconds from each link drop's end to the first "
             "epoch its worker showed after it that was credited (-: it left or was killed first).",
             "", "| seed | minutes | algorithm | network | events | link back s | epochs | uncredited epochs (share of "
             "samples) | unconfirmed "
             "epochs (share) | double credited | banned past bound | tracebacks | longest stall s | RSS growth per "
             "hour (after warm-up) | viewers: requests, 5xx, unanswered, p95 ms |",
             "| ---: | ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        events = ", ".join(f"{v} {k}" for k, v in r["events"].items() if v)
        if r.get("tokens_expired"):
            events += (f"; {r['tokens_expired']} tokens expired, "
                       f"{len(r['expired_never_resumed'])} of them never trained again")
        growth = ", ".join(f"{k} {v:+.1%}" for k, v in r["rss_growth_per_hour"].items() if v is not None)
        unconfirmed = (f"{r['unconfirmed_epochs']} ({r['unconfirmed_samples_share']:.1%})"
                       if "unconfirmed_epochs" in r else "-")
        gap = (f"; snapshots {r['longest_snapshot_gap_seconds']}" if "longest_snapshot_gap_seconds" in r else "")
        viewers = (f"{r['viewer_requests']}, {r['viewer_errors']}, {r['viewer_unanswered']}, {r['viewer_p95_ms']}"
                   if "viewer_requests" in r else "-")
        back = ", ".join("-" if s is None else f"{s:g}" for s in r.get("link_recovery_seconds", [])) or "-"
        network = f"{r.get('network', 'loopback')}, matchmaking {r.get('matchmaking_seconds', 1.0):g} s"
        lines.append(f"| {r['seed']} | {r['minutes']:g} | {r['algorithm']} | {network} | "
                     f"{events} | {back} | {r['epochs']} | "
                     f"{r['uncredited_epochs']} of {r['honest_claims']} ({r['uncredited_samples_share']:.1%}) | "
                     f"{unconfirmed} | "
                     f"{r['double_credited_epochs']} | {r['banned_credit_past_bound']} | {r['tracebacks']} | "
                     f"{r['longest_stall_seconds']} ({r['longest_stall_near']}{gap}) | {growth} | {viewers} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--algorithm", choices=("large-batch", "local-updates"), default="large-batch")
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    parser.add_argument("--keep", type=Path, help="copy the run's folder (logs, database) here")
    parser.add_argument("--network", choices=("emulated", "loopback"),
                        help="workers on hosts of their own in network namespaces (the default where this machine "
                        "can build them), or all on loopback")
    args = parser.parse_args(argv)
    if args.workers < MIN_RUNNING + 1:
        parser.error(f"--workers must be at least {MIN_RUNNING + 1}")
    why_not = netns.unavailable()
    if args.network == "emulated" and why_not:
        parser.error(f"--network emulated: {why_not}")
    if args.network is None and why_not:
        print(f"workers on loopback: {why_not}", flush=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    row = run(args.minutes, args.seed, args.algorithm, args.workers, args.keep,
              emulated=args.network == "emulated" or (args.network is None and not why_not))
    print(json.dumps(row), flush=True)
    rows = json.loads(args.out.read_text()) if args.out.exists() else []
    rows.append(row)
    write_results(args.out, rows, markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
