"""Several GPUs of one machine (``dedloc-worker join --devices``): which GPUs a value names, what each GPU's process
is told, and the launcher's handling of real child processes: their lines prefixed, a stop that ends every one of
them and what they started within seconds, a failure that leaves the others training. The refusals on a machine
without CUDA run the real command in tests/test_cli.py."""

from __future__ import annotations

import io
import re
import sys
import threading
import time
from pathlib import Path

import pytest
from dedloc_common.cleanup import live_processes
from dedloc_worker.cli import build_parser
from dedloc_worker.errors import RUN_FINISHED, ConfigError
from dedloc_worker.launcher import Child, child_argv, refuse_conflicts, run_children, visible_name
from dedloc_worker.training import device

JOIN = ["join", "http://portal.example", "--run", "r"]


def test_all_names_every_gpu_and_a_list_names_those_in_its_order():
    assert device.gpus("all", gpu_count=4) == [0, 1, 2, 3]
    assert device.gpus("all", gpu_count=1) == [0]
    assert device.gpus("2,0", gpu_count=4) == [2, 0]
    assert device.gpus(" 1 ", gpu_count=2) == [1]


@pytest.mark.parametrize("value, gpu_count, words", [
    ("0,0", 2, "--devices 0,0: GPU 0 is named twice; name each GPU once"),
    ("1,2,1", 4, "GPU 1 is named twice"),
    ("0,2", 2, "--devices 0,2: there is no GPU 2; this machine has 2 CUDA GPUs, 0 to 1"),
    ("1", 1, "there is no GPU 1; this machine has 1 CUDA GPU, 0 "),
    ("all", 0, "--devices all: this machine has no CUDA GPU torch can use (torch.cuda.device_count() is 0); run "
               "without --devices to train on the CPU, or install a CUDA build of torch"),
    ("0,1", 0, "--devices 0,1: this machine has no CUDA GPU"),
    ("foo", 2, "--devices 'foo': use all, or GPU indices separated by commas, such as 0,2"),
    ("", 2, "--devices '': use all"),
    ("-1", 2, "--devices '-1': use all"),
    ("0,,1", 2, "--devices '0,,1': use all"),
    ("ALL", 2, "--devices 'ALL': use all"),
])
def test_a_value_that_names_no_gpu_of_this_machine_is_refused_with_what_to_do(value, gpu_count, words):
    with pytest.raises(ConfigError) as refused:
        device.gpus(value, gpu_count=gpu_count)
    assert words in str(refused.value)


def test_this_machines_own_gpu_count_is_read_when_not_given():
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            device.gpus("all")
    else:
        assert device.gpus("all") == list(range(count))


def test_a_gpu_shown_alone_to_its_process_is_named_in_the_hardware_peers_report():
    one = device.choose("cuda", cuda_available=True, bf16_supported=True, gpu_name="NVIDIA H100", visible="2")
    assert one.description == "cuda: NVIDIA H100 (GPU 2, bfloat16 mixed precision)"
    # the portal's planner reads the device from before the colon
    assert one.description.split(":", 1)[0] == "cuda"
    for visible in ("", "0,1"):
        several = device.choose("cuda", cuda_available=True, bf16_supported=False, gpu_name="Tesla T4",
                                visible=visible)
        assert several.description == "cuda: Tesla T4 (float16 mixed precision)"


def test_a_child_is_shown_the_gpu_its_parent_was_shown():
    assert [visible_name(index, None) for index in (0, 2)] == ["0", "2"]
    assert [visible_name(index, "4, 6") for index in (0, 1)] == ["4", "6"]  # torch's index 1 here is GPU 6
    assert visible_name(0, "GPU-5d3c") == "GPU-5d3c"


def test_every_join_option_reaches_each_gpus_process():
    """A join option added later fails here until ``child_argv`` passes it on (or refuses it with --devices)."""
    parser = build_parser()
    given = parser.parse_args([*JOIN, "--listen", "/ip4/0.0.0.0/tcp/4000", "--no-client", "--max-epochs", "5",
                               "--wait", "7.5", "--report", "out/report.json", "--state-out", "state.pt", "--verbose",
                               "--threads", "3", "--devices", "all", "--device", "cuda"])
    defaults = vars(parser.parse_args(JOIN))
    untouched = {name for name, value in vars(given).items() if value == defaults[name]}
    assert untouched == {"command", "portal", "run", "aux"}  # --aux is refused with --devices

    child = parser.parse_args(child_argv(given, 1, "5", threads=3)[3:])
    assert child_argv(given, 1, "5", threads=3)[:3] == [sys.executable, "-m", "dedloc_worker"]
    assert vars(child) == {**vars(given), "listen": "/ip4/0.0.0.0/tcp/4001", "report": Path("out/report.gpu5.json"),
                           "state_out": Path("state.gpu5.pt"), "devices": None}

    forced = parser.parse_args([*JOIN, "--client", "--devices", "all"])
    assert parser.parse_args(child_argv(forced, 0, "0", threads=2)[3:]).client is True
    plain = parser.parse_args(child_argv(parser.parse_args([*JOIN, "--devices", "all"]), 3, "3", threads=2)[3:])
    assert (plain.client, plain.listen, plain.report, plain.device, plain.threads) == (
        None, "/ip4/0.0.0.0/tcp/0", None, "cuda", 2)  # port 0 (any free port) stays 0


def test_devices_with_the_cpu_or_an_auxiliary_peer_is_refused():
    parser = build_parser()
    with pytest.raises(ConfigError, match="--device cpu"):
        refuse_conflicts(parser.parse_args([*JOIN, "--devices", "all", "--device", "cpu"]))
    with pytest.raises(ConfigError, match="--aux trains nothing"):
        refuse_conflicts(parser.parse_args([*JOIN, "--devices", "all", "--aux"]))
    refuse_conflicts(parser.parse_args([*JOIN, "--devices", "all", "--device", "auto"]))


# The launcher, with harmless children in place of join processes ------------------------------------------------

# A child that starts a grandchild deaf to SIGTERM (as hivemind's processes can be), says so, and leaves on SIGTERM.
TRAINING = """
import signal, subprocess, sys, time
deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
grandchild = subprocess.Popen([sys.executable, "-c", deaf])
print("grandchild", grandchild.pid, flush=True)
print("a warning", file=sys.stderr, flush=True)
def leave(*_):
    print("left the swarm", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, leave)
print("training", flush=True)
time.sleep(600)
"""
STUCK = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('training', flush=True); " \
        "time.sleep(600)"


def child(label: str, script: str) -> Child:
    return Child(label, [sys.executable, "-c", script], {})


def alive(pids) -> set[int]:
    return {process.pid for process in live_processes()} & set(pids)


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class Launch:
    """``run_children`` in a thread, as the CLI's main thread runs it, with its output captured."""

    def __init__(self, children, grace: float = 10.0):
        self.out, self.err, self.stop, self.result = io.StringIO(), io.StringIO(), threading.Event(), []
        self.thread = threading.Thread(target=lambda: self.result.append(
            run_children(children, self.stop, self.out, self.err, grace=grace)))
        self.thread.start()

    def lines(self) -> list[str]:
        return self.out.getvalue().splitlines()

    def end(self, timeout: float) -> int:
        self.stop.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the launcher did not return"
        return self.result[0]


def test_a_stop_reaches_every_child_and_ends_what_each_started_within_seconds():
    launch = Launch([child("gpu 0", TRAINING), child("gpu 1", TRAINING)])
    try:
        wait_for(lambda: sum(line.endswith("] training") for line in launch.lines()) == 2)
        grandchildren = [int(re.search(r"grandchild (\d+)", line)[1]) for line in launch.lines()
                         if "grandchild" in line]
        assert len(grandchildren) == 2 and alive(grandchildren) == set(grandchildren)
        started = time.monotonic()
    finally:
        code = launch.end(timeout=15)
    assert time.monotonic() - started < 5
    assert code == 0
    assert not alive(grandchildren)  # deaf to SIGTERM, ended with their child's group
    lines = launch.lines()
    for label in ("gpu 0", "gpu 1"):  # each child's lines, whole and prefixed, in its own order
        own = [line for line in lines if line.startswith(f"[{label}] ")]
        assert [line.split("] ", 1)[1].split()[0] for line in own] == ["grandchild", "training", "left"]
    assert sorted(launch.err.getvalue().splitlines()) == ["[gpu 0] a warning", "[gpu 1] a warning"]


def test_a_child_that_does_not_leave_is_ended_after_the_grace():
    launch = Launch([child("gpu 0", STUCK)], grace=1.0)
    try:
        wait_for(lambda: launch.lines() == ["[gpu 0] training"])
        started = time.monotonic()
    finally:
        code = launch.end(timeout=15)
    assert time.monotonic() - started < 5
    assert code == 1  # killed: it did not leave the swarm cleanly


def test_a_failed_gpu_leaves_the_others_training_and_its_code_is_the_launchers():
    failing = "import sys; print('dedloc-worker: the model does not fit', file=sys.stderr); sys.exit(8)"
    launch = Launch([child("gpu 0", TRAINING), child("gpu 1", failing)])
    try:
        wait_for(lambda: "the other GPUs train on" in launch.err.getvalue())
        assert [line for line in launch.err.getvalue().splitlines() if line.startswith("[gpu 1]")] == [
            "[gpu 1] dedloc-worker: the model does not fit", "[gpu 1] stopped (exit code 8); the other GPUs train on"]
        wait_for(lambda: "[gpu 0] training" in launch.lines())
    finally:
        code = launch.end(timeout=15)
    assert code == 8
    assert "[gpu 0] left the swarm" in launch.lines()


def test_children_that_all_exit_end_the_launch_with_the_runs_end():
    done = [child("gpu 0", f"raise SystemExit({RUN_FINISHED})"), child("gpu 1", "print('done')")]
    out = io.StringIO()
    assert run_children(done, threading.Event(), out, io.StringIO(), grace=5.0) == RUN_FINISHED
    assert out.getvalue() == "[gpu 1] done\n"
