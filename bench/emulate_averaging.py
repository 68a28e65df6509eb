"""Seconds per averaging round on emulated links: real hivemind rounds (and a gloo ring) between network namespaces.

    python -m bench.emulate_averaging [--rounds N] [--profile NAME ...] [--out bench/results/averaging_emu.json]
    python -m bench.emulate_averaging --quick --out PATH      # one short profile, for the test suite

Four peers, each in its own network namespace, hang off one bridge in a fifth namespace (a star); every link is
shaped with ``tc tbf`` and TCP uses CUBIC. Each peer averages a 10 MB fp32 vector with a ``PlannedAverager``
(``dedloc_worker.averaging.planned``), several rounds per profile, the modes (ring: gloo's all-reduce; tcp: the
planner's bytes as plain TCP, ``bench.raw_tcp``; equal; hivemind: hivemind's own split; planner:
``app.planner.plan_averaging``) interleaved and rotated within each round. Every round is checked against the true
mean (tcp: every byte arrived); a failed round is counted, left out of the median and retried.

How it measures, what each setting is for and what it found (hold-back, the window of parts in flight, part size,
the drain, what limits 4x100): docs/benchmarks.md#averaging-emulation and
docs/benchmarks.md#averaging-emulation-findings. Current figures: bench/results/averaging.md.

The bench needs root (namespaces); without it, it writes one "skipped" entry and exits 0. It talks only to
addresses inside the namespaces it creates, and removes them, and every process it started, even on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dedloc_common.contract import GRADIENT_PART_BYTES

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path("bench/results/averaging_emu.json")
VECTOR_BYTES = 10**7  # 10 MB: 2.5 million fp32 values per peer
QUICK_VECTOR_BYTES = 10**6
MBIT = 1e6 / 8  # bytes per second in one Mbit/s
MODES = ("ring", "tcp", "equal", "hivemind", "planner")
SUBNET = "10.47.0"
RING_PORT = 29500
BURST_BYTES = 16384  # tbf bucket; larger GSO packets are split by tbf itself
QUEUE_MS = 20.0  # default tbf queue, milliseconds at the link's rate (docs/benchmarks.md#settings)
PART_BYTES = GRADIENT_PART_BYTES  # hivemind's part_size_bytes, every mode: the worker's (docs/benchmarks.md#part-size)
MATCHMAKING_S = 1.0  # hivemind's min_matchmaking_time; the group starts early once all four peers joined
REPLY_TIMEOUT_S = 180.0
ROUNDS = 9  # per mode and profile: rounds spread widely here (docs/benchmarks.md#spread-between-runs)
RETRIES = 2  # a failed round is retried this many times (each failure is counted and reported)
FAILURE_KINDS = ("error", "partial", "wrong")  # raised / flagged by hivemind ("received X%") / silently wrong
RESULT_TOLERANCE = 1e-5  # max |result - true mean| for fp32 means of four N(0, 1) values
HIVEMIND_WARNING = re.compile(r"received [\d.]+% (results|of input tensors)")


@dataclass(frozen=True)
class Link:
    """One peer's access link: rates in Mbit/s; a client-mode peer accepts no incoming connection (NAT)."""

    up: float
    down: float
    client: bool = False


@dataclass(frozen=True)
class Profile:
    """Four peers' links, in the order the peers start (the first, never in client mode, bootstraps the rest)."""

    links: tuple[Link, ...]
    note: str = ""
    scale: float = 1.0  # link rates relative to the profile the name gives
    ring: bool = True  # False where gloo cannot run: it needs every rank to accept connections


PROFILES: dict[str, Profile] = {
    "4x100": Profile((Link(100, 100),) * 4),
    "400+3x50": Profile(
        (Link(100, 100),) + (Link(12.5, 12.5),) * 3, scale=0.25,
        note="scaled 1/4 to 100 + 3 x 12.5 Mbit/s: on 2 cores peers cannot carry 400 Mbit/s "
             "(docs/benchmarks.md#staying-within-the-cpu: cap 100)",
    ),
    "nat-4x100": Profile(
        (Link(100, 100),) * 3 + (Link(100, 100, client=True),), ring=False,
        note="4 x 100 Mbit/s, the fourth peer in client mode, listening on its own loopback only (unreachable)",
    ),
    "asym-100/20": Profile(
        (Link(100, 100),) + (Link(20, 100),) * 3,
        note="one 100/100 Mbit/s peer and three home links of 100 Mbit/s down / 20 up",
    ),
}
QUICK = Profile((Link(100, 100),) * 4, note="quick: 1 MB vector, one round")


@dataclass(frozen=True)
class Settings:
    """What every profile of a run shares: the tbf queue (ms at the link's rate) and hivemind's part size (bytes)."""

    queue_ms: float = QUEUE_MS
    part_bytes: int = PART_BYTES
    sndbuf_bytes: int | None = None  # cap on the peers' TCP send buffers (tcp_wmem max); None: the kernel default
    modes: tuple[str, ...] = MODES  # the modes to run (a subset for an experiment; the others read None)


# --- network namespaces ------------------------------------------------------------------------------------------


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


class Star:
    """A bridge namespace and one namespace per peer, shaped with tbf; ``close`` removes all of it."""

    def __init__(self, links: Sequence[Link], queue_ms: float, sndbuf_bytes: int | None = None) -> None:
        self.prefix = f"dedloc-emu-{os.getpid()}-"
        self.bridge = self.prefix + "br"
        self.peers = [f"{self.prefix}p{i}" for i in range(len(links))]
        self.created: list[str] = []
        try:
            self._add(self.bridge)
            sh("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.bridge, "link", "set", "br0", "up")
            for i, (ns, link) in enumerate(zip(self.peers, links)):
                self._add(ns)
                sh("ip", "-n", self.bridge, "link", "add", f"vp{i}", "type", "veth",
                   "peer", "name", "eth0", "netns", ns)
                sh("ip", "-n", self.bridge, "link", "set", f"vp{i}", "master", "br0", "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
                # CUBIC on every route, including the peer's own address (gloo's store is reached through it)
                sh("ip", "-n", ns, "route", "replace", f"{SUBNET}.0/24", "dev", "eth0", "congctl", "cubic")
                sh("ip", "-n", ns, "route", "replace", "table", "local", "local", self.ip(i), "dev", "eth0",
                   "proto", "kernel", "scope", "host", "src", self.ip(i), "congctl", "cubic")
                if sndbuf_bytes:  # a host setting of the peer, not of the link (docs/benchmarks.md#send-buffer-cap)
                    sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                       f"net.ipv4.tcp_wmem=4096 16384 {sndbuf_bytes}")
                shape(ns, "eth0", link.up, queue_ms)  # upload: what leaves the peer
                shape(self.bridge, f"vp{i}", link.down, queue_ms)  # download: what the bridge hands to the peer
        except BaseException:
            self.close()
            raise

    def _add(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self.created.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    @staticmethod
    def ip(index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def congestion_controls(self, index: int) -> dict[str, int]:
        """Congestion control of every TCP connection of peer ``index`` to another peer: {name: count}."""
        out = subprocess.run(["ip", "netns", "exec", self.peers[index], "ss", "-tin", "dst", f"{SUBNET}.0/24"],
                             capture_output=True, text=True, timeout=30).stdout
        counts: dict[str, int] = {}
        for name in re.findall(r"^\s+(?:ts\s+)?(?:sack\s+)?(?:ecn\s+)?(\w+) wscale", out, re.M):
            counts[name] = counts.get(name, 0) + 1
        return counts

    def close(self) -> None:
        for ns in reversed(self.created):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:  # only processes we started can live in namespaces we created
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()


def shape(ns: str, dev: str, mbit: float, queue_ms: float) -> None:
    """tbf at ``mbit`` Mbit/s with a 16 KB bucket and a queue of ``queue_ms`` milliseconds at that rate."""
    rate = mbit * MBIT
    sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(mbit * 1000)}kbit",
       "burst", str(BURST_BYTES), "limit", str(BURST_BYTES + int(rate * queue_ms / 1000)))


def namespaces_unavailable() -> str | None:
    """Why this machine cannot run the bench, or None."""
    if os.geteuid() != 0:
        return "not root: network namespaces need root"
    for tool in ("ip", "tc", "ss"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"dedloc-emu-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


# --- peers -------------------------------------------------------------------------------------------------------


class Peer:
    """A peer process inside its namespace, driven by JSON lines on its stdin and stdout; stderr goes to ``log``."""

    def __init__(self, ns: str, log: Path) -> None:
        self.log, self._log_offset = log, 0
        with open(log, "wb") as out:
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "bench.emulate_averaging", "--peer-process"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out, cwd=ROOT, env=env, text=True,
                start_new_session=True,
            )
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._replies.put(json.loads(line))
        self._replies.put(None)

    def send(self, **message) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = REPLY_TIMEOUT_S) -> dict:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            reply = None
        if reply is None:
            raise RuntimeError(f"peer process gave no reply; its log ends:\n{self.log_tail()}")
        return reply

    def new_warnings(self) -> list[str]:
        """hivemind's "received X%" warnings logged since the last call."""
        with open(self.log, "rb") as log:
            log.seek(self._log_offset)
            text = log.read().decode(errors="replace")
        self._log_offset += len(text.encode())
        return [line for line in text.splitlines() if HIVEMIND_WARNING.search(line)]

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send(cmd="quit")
                self.proc.wait(15)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # hivemind's DHT, averager and p2pd share the group
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def peer_process() -> int:
    """Inside a namespace: one hivemind peer (DHT + PlannedAverager), optionally a gloo rank; see ``run_mode``."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to the log, not into the protocol
    config = json.loads(sys.stdin.readline())
    import hivemind
    import torch
    from dedloc_worker.averaging.planned import PlannedAverager

    torch.set_num_threads(1)
    listen = "/ip4/127.0.0.1/tcp/0" if config["client"] else f"/ip4/{config['ip']}/tcp/0"
    dht = hivemind.DHT(initial_peers=config["initial_peers"], host_maddrs=[listen], client_mode=config["client"],
                       start=True)
    averager = robust = None
    options = dict(start=True, client_mode=config["client"], target_group_size=config["world"],
                   min_group_size=config["world"], min_matchmaking_time=MATCHMAKING_S,
                   request_timeout=MATCHMAKING_S / 2, allreduce_timeout=REPLY_TIMEOUT_S / 2,
                   part_size_bytes=config["part_bytes"])
    try:
        averager = PlannedAverager([torch.zeros(config["elements"])], dht, prefix="emu", **options)
        if config.get("robust"):  # bench.robust_cost: a second averager that aggregates with CenteredClip
            from dedloc_worker.averaging.robust import RobustRule

            robust = PlannedAverager([torch.zeros(config["elements"])], dht, prefix="emu_robust",
                                     robust=RobustRule(**config["robust"]), **options)
        maddrs = [str(a) for a in dht.get_visible_maddrs() if config["ip"] in str(a)]
        protocol.write(json.dumps({"peer_id": str(dht.peer_id), "maddrs": maddrs}) + "\n")
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] == "quit":
                break
            chosen = robust if command.get("robust") else averager
            protocol.write(json.dumps(run_mode(chosen, config, command)) + "\n")
    finally:
        for started in (averager, robust):
            if started is not None:
                started.shutdown()
        dht.shutdown()
    return 0


def run_mode(averager, config: dict, command: dict) -> dict:
    """One round in one mode on fresh vectors seeded by ``command["seed"]``; checks the result on this peer."""
    import torch

    world, index = config["world"], config["index"]
    vectors = [torch.randn(config["elements"], generator=torch.Generator().manual_seed(command["seed"] + j))
               for j in range(world)]
    reply: dict = {"ok": False}
    if command["cmd"] == "tcp":  # no vector: the planner's round as plain TCP traffic (bench.raw_tcp)
        from bench import raw_tcp

        raw_tcp.connect(index, config["ips"], config["clients"])
        began, ended, received = raw_tcp.exchange(command["volumes"], index)
        ok = received == sum(command["volumes"])
        return dict(ok=ok, group=world, began=began, ended=ended, error_max=0.0,
                    **({} if ok else {"error": f"received {received} of {sum(command['volumes'])} bytes"}))
    if command["cmd"] == "ring":
        result, began, ended = ring_allreduce(vectors[index], config)
        reply.update(group=world, began=began, ended=ended)
    else:
        averager.bandwidth = command.get("bandwidth")
        averager.set_plan(command.get("shares"))
        with averager.get_tensors() as (tensor,):
            tensor.copy_(vectors[index])
        asked = time.time()
        try:
            gathered = averager.step(timeout=60)
        except Exception as e:  # hivemind raises whatever its round raised; the round failed
            return {**reply, "error": repr(e)}
        outcome = averager.last_round(timeout=30)
        if outcome is None or outcome.began < asked:
            return {**reply, "error": "no all-reduce outcome for this round"}
        with averager.get_tensors() as (tensor,):
            result = tensor.clone()
        reply.update(group=len(gathered), began=outcome.began, ended=outcome.ended, complete=outcome.complete,
                     aggregated=outcome.aggregated_elements,
                     fractions=dict(zip(outcome.peer_ids, outcome.fractions)))
    reply["error_max"] = float((result - torch.stack(vectors).mean(0)).abs().max())
    reply["ok"] = reply["group"] == world and reply.get("complete", True) and reply["error_max"] < RESULT_TOLERANCE
    return reply


def ring_allreduce(vector, config: dict) -> tuple:
    """gloo's all_reduce (a ring) of ``vector``; returns (the mean, began, ended), times in unix seconds."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://{config['ring_master']}:{RING_PORT}",
                                rank=config["index"], world_size=config["world"],
                                timeout=datetime.timedelta(seconds=REPLY_TIMEOUT_S / 2))
    tensor = vector.clone()
    dist.barrier()
    began = time.time()
    dist.all_reduce(tensor)
    ended = time.time()
    return tensor.div_(config["world"]), began, ended


# --- one profile -------------------------------------------------------------------------------------------------


def start_peers(star: Star, profile: Profile, elements: int, part_bytes: int, logs: Path,
                name: str, robust: dict | None = None) -> tuple[list[Peer], list[str]]:
    """Start one peer per namespace (the first bootstraps the others); returns the peers and their PeerIDs.

    :param robust: ``RobustRule`` arguments: each peer also runs an averager with them (``robust`` commands)
    """
    peers: list[Peer] = []
    for i, ns in enumerate(star.peers):
        peers.append(Peer(ns, logs / f"{re.sub(r'[^A-Za-z0-9]+', '_', name)}-p{i}.log"))
    config = dict(world=len(peers), elements=elements, ring_master=star.ip(0), part_bytes=part_bytes, robust=robust,
                  ips=[star.ip(i) for i in range(len(peers))], clients=[link.client for link in profile.links])
    peers[0].send(**config, index=0, ip=star.ip(0), client=profile.links[0].client, initial_peers=[])
    first = peers[0].recv()
    for i, (peer, link) in enumerate(zip(peers[1:], profile.links[1:]), 1):
        peer.send(**config, index=i, ip=star.ip(i), client=link.client, initial_peers=first["maddrs"])
    return peers, [first["peer_id"]] + [peer.recv()["peer_id"] for peer in peers[1:]]


def run_profile(name: str, profile: Profile, rounds: int, vector_bytes: int, net: "Settings", logs: Path) -> dict:
    """Every mode, ``rounds`` times interleaved, on fresh namespaces; returns the result row."""
    from app.planner import PeerProfile, lower_bound_seconds, plan_averaging

    star, peers = Star(profile.links, net.queue_ms, net.sndbuf_bytes), []
    try:
        peers, ids = start_peers(star, profile, vector_bytes // 4, net.part_bytes, logs, name)
        planned = [PeerProfile(peer, 1.0, link.up * MBIT, link.down * MBIT, client_mode=link.client)
                   for peer, link in zip(ids, profile.links)]
        plan = plan_averaging(planned, vector_bytes, hold_back=False)  # planned groups stream: no hold-back
        commands = {
            "ring": [dict(cmd="ring")] * len(peers),
            "equal": [dict(cmd="average")] * len(peers),
            # in Mbit/s, the unit of hivemind's examples; the unit changes which slow peers get exactly zero
            # (docs/benchmarks.md#unit-of-the-announced-bandwidth)
            "hivemind": [dict(cmd="average", bandwidth=min(link.up, link.down)) for link in profile.links],
            "planner": [dict(cmd="average", shares=plan.shares)] * len(peers),
            # the planner's round as plain TCP: V * (s_i + s_j) bytes each way between peers i and j (bench.raw_tcp)
            "tcp": [dict(cmd="tcp", volumes=[0 if j == i else round(vector_bytes * (plan.shares[a] + plan.shares[b]))
                                             for j, b in enumerate(ids)]) for i, a in enumerate(ids)],
        }
        modes = [mode for mode in net.modes if profile.ring or mode != "ring"]
        seconds: dict[str, list[float]] = {mode: [] for mode in modes}
        failed = {mode: {kind: 0 for kind in FAILURE_KINDS} for mode in modes}
        fractions: dict[str, list[float]] = {}
        congestion: dict[str, int] = {}
        seed = 1
        for r in range(rounds):
            # each round starts one mode further on, so that every mode follows every other equally often
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                for _ in range(1 + RETRIES):
                    seed += len(peers)
                    outcome, replies, why = run_round(peers, commands[mode], seed)
                    if outcome == "ok":
                        ends, starts = (reply["ended"] for reply in replies), (reply["began"] for reply in replies)
                        seconds[mode].append(max(ends) - min(starts))
                        if "fractions" in replies[0]:
                            fractions[mode] = [round(replies[0]["fractions"][peer], 6) for peer in ids]
                        break
                    failed[mode][outcome] += 1
                    print(f"  round {r + 1} {mode}: failed ({outcome}): {why}", flush=True)
            if r == 0:
                for i in range(len(peers)):
                    for algorithm, count in star.congestion_controls(i).items():
                        congestion[algorithm] = congestion.get(algorithm, 0) + count
            done = ", ".join(f"{mode} {seconds[mode][-1]:.2f}" for mode in modes if len(seconds[mode]) > 0)
            print(f"  round {r + 1}/{rounds}: {done} s", flush=True)
        row = result_row(name, profile, vector_bytes, rounds, seconds, failed, fractions, planned, plan,
                         lower_bound_seconds(planned, vector_bytes, hold_back=False))
        row.update(queue_ms=net.queue_ms, part_bytes=net.part_bytes, tcp_congestion=congestion,
                   peer_tcp_wmem_max=net.sndbuf_bytes)
        return row
    finally:
        with signals_ignored():
            for peer in peers:
                peer.stop()
            star.close()


def run_round(peers: list[Peer], commands: list[dict], seed: int) -> tuple[str, list[dict], str]:
    """One round on every peer; returns ("ok" or a failure kind, the replies, why it failed)."""
    for peer, command in zip(peers, commands):
        peer.send(**command, seed=seed)
    replies = [peer.recv() for peer in peers]
    warnings = [line.strip() for peer in peers for line in peer.new_warnings()]
    errors = [f"p{i}: {reply['error']}" for i, reply in enumerate(replies) if reply.get("error")]
    if errors:
        return "error", replies, "; ".join(errors)[:1000]
    incomplete = [f"p{i} incomplete" for i, reply in enumerate(replies) if not reply.get("complete", True)]
    if warnings or incomplete:
        return "partial", replies, "; ".join(incomplete + warnings)[:1000]
    wrong = [f"p{i}: group of {reply['group']}, max error {reply['error_max']:.3g}"
             for i, reply in enumerate(replies) if not reply["ok"]]
    return ("wrong", replies, "; ".join(wrong)) if wrong else ("ok", replies, "")


def result_row(name, profile, vector_bytes, rounds, seconds, failed, fractions, planned, plan, lower_bound) -> dict:
    """The JSON row of one profile: medians in seconds per round, plus what explains them."""
    from app.planner import equal_split_seconds, hivemind_split_seconds, ring_allreduce_seconds

    median = {mode: round(statistics.median(times), 4) if times else None for mode, times in seconds.items()}
    row = {"profile": name, "mode": "emu", **{mode: median.get(mode) for mode in MODES},
           "lower_bound": round(lower_bound, 4)}
    if not profile.ring:
        row["ring_note"] = ("not run: gloo (torch.distributed) needs every rank to accept connections, and the "
                            "client-mode peer accepts none")
    for numerator, denominator in (("planner", "lower_bound"), ("planner", "equal"), ("hivemind", "equal"),
                                   ("equal", "lower_bound"), ("ring", "planner"),
                                   ("tcp", "lower_bound"), ("planner", "tcp")):
        if row.get(numerator) and row.get(denominator):
            row[f"{numerator}_over_{denominator}"] = round(row[numerator] / row[denominator], 3)
    row.update(
        note=profile.note, scale=profile.scale, vector_bytes=vector_bytes, rounds=rounds,
        links_mbit=[{"up": link.up, "down": link.down, "client_mode": link.client} for link in profile.links],
        failed_rounds=failed, seconds={mode: [round(t, 4) for t in times] for mode, times in seconds.items()},
        model={"ring": round(ring_allreduce_seconds(planned, vector_bytes), 4) if profile.ring else None,
               "equal": round(equal_split_seconds(planned, vector_bytes), 4),
               "hivemind": round(hivemind_split_seconds(planned, vector_bytes), 4),
               "planner": round(plan.predicted_seconds, 4)},
        planner_shares=[round(plan.shares[p.peer], 6) for p in planned],
        measured_fractions=fractions,
    )
    return row


class signals_ignored:
    """Ignore SIGINT and SIGTERM while cleaning up, so that a second Ctrl-C cannot leave namespaces behind."""

    def __enter__(self):
        self._saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}

    def __exit__(self, *exc):
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


# --- command line ------------------------------------------------------------------------------------------------

HEADERS = ("ring", "tcp", "equal", "hivemind", "planner", "lower bound", "planner/bound", "planner/equal", "failed")


def format_table(rows: Sequence[dict]) -> str:
    """The rows as a fixed-width text table, seconds per round (median)."""
    width = max(len(row["profile"]) for row in rows) + 2
    lines = ["profile".ljust(width) + "".join(h.rjust(14) for h in HEADERS)]
    for row in rows:
        cells = [row.get(key) for key in (*MODES, "lower_bound", "planner_over_lower_bound", "planner_over_equal")]
        text = ["-" if cell is None else f"{cell:.3f}" for cell in cells]
        text.append(str(failures(row)) if "failed_rounds" in row else "-")
        lines.append(row["profile"].ljust(width) + "".join(cell.rjust(14) for cell in text))
    return "\n".join(lines)


def failures(row: dict) -> int:
    """Failed attempts of every mode of a row."""
    return sum(sum(kinds.values()) for kinds in row["failed_rounds"].values())


def skipped_row(reason: str) -> dict:
    return {"profile": "emulation", "mode": "emu", **{mode: None for mode in MODES}, "lower_bound": None,
            "skipped": reason}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.emulate_averaging", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results file (default {DEFAULT_OUT})")
    parser.add_argument("--profile", action="append", choices=sorted(PROFILES), help="profile to run (repeatable)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds per mode and profile (default {ROUNDS})")
    parser.add_argument("--queue-ms", type=float, default=QUEUE_MS, help=f"tbf queue, ms (default {QUEUE_MS:g})")
    parser.add_argument("--part-kib", type=int, default=PART_BYTES // 1024,
                        help=f"hivemind's part_size_bytes, KiB, for every mode (default {PART_BYTES // 1024})")
    parser.add_argument("--peer-sndbuf-kib", type=int, help="cap the peers' TCP send buffers at this many KiB "
                        "(tcp_wmem max, a host setting; default: the kernel's own autotuning, up to 4 MiB)")
    parser.add_argument("--mode", action="append", choices=MODES, help="mode to run (repeatable; default: all)")
    parser.add_argument("--quick", action="store_true", help="one 4 x 100 Mbit/s round of a 1 MB vector (tests)")
    parser.add_argument("--logs", type=Path, help="keep the peers' logs here (default: a temporary folder, "
                        "removed unless a round failed)")
    parser.add_argument("--peer-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer_process:
        return peer_process()

    reason = namespaces_unavailable()
    if reason:
        print(f"emulation skipped: {reason}")
        rows = [skipped_row(reason)]
    else:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even where a shell started us ignoring it
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _exit_on_signal)
        jobs = [("quick-4x100", QUICK, 1, QUICK_VECTOR_BYTES)] if args.quick else [
            (name, PROFILES[name], args.rounds, VECTOR_BYTES) for name in args.profile or PROFILES]
        try:
            sndbuf = args.peer_sndbuf_kib * 1024 if args.peer_sndbuf_kib else None
            modes = tuple(mode for mode in MODES if mode in args.mode) if args.mode else MODES
            rows = run_all(jobs, Settings(args.queue_ms, args.part_kib * 1024, sndbuf, modes), args.logs)
        except KeyboardInterrupt:
            print("interrupted: the namespaces and peer processes of this run are removed")
            return 130
        print(f"seconds per averaging round, median (emulated links, tbf queue {args.queue_ms:g} ms, "
              f"{args.part_kib} KiB parts, V = {jobs[0][3]} bytes, 4 peers)")
        print(format_table(rows))
        for row in rows:
            if row.get("note"):
                print(f"  {row['profile']}: {row['note']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def run_all(jobs: list[tuple[str, Profile, int, int]], net: Settings | None = None,
            logs: Path | None = None) -> list[dict]:
    """Run each (name, profile, rounds, vector bytes) job; peers' logs go to ``logs`` (else a temporary folder)."""
    net, keep = net or Settings(), logs is not None
    if logs is None:
        logs = Path(tempfile.mkdtemp(prefix="dedloc-emu-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    rows, ok = [], False
    try:
        for name, profile, rounds, vector_bytes in jobs:
            print(f"profile {name}: {rounds} round(s) of {', '.join(net.modes)}", flush=True)
            started = time.monotonic()
            rows.append(run_profile(name, profile, rounds, vector_bytes, net, logs))
            rows[-1]["wall_seconds"] = round(time.monotonic() - started, 1)
        ok = not any(failures(row) for row in rows)
    finally:
        if ok and not keep:
            shutil.rmtree(logs, ignore_errors=True)
        else:
            print(f"peer logs in {logs}")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
