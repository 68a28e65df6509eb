"""The emulation bench in its quick form: four hivemind peers in network namespaces, real sockets, tbf links.

Needs root (network namespaces); elsewhere it is skipped with the reason. The full form is ``make bench``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

from bench.emulate_averaging import MODES, namespaces_unavailable
from tests.support.harness import ROOT

# hivemind peers in processes of their own: the swarm pass, with the machine to itself (in the parallel pass, beside
# the browser tests, its 12 s run once outlasted its 60 s)
pytestmark = pytest.mark.swarm

KEYS = {"profile", "mode", "ring", "equal", "hivemind", "planner", "lower_bound"}


@pytest.mark.timeout(90)
def test_quick_emulation_averages_correctly_in_every_mode_and_leaves_no_namespace(tmp_path):
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(f"the emulation bench cannot run here: {reason}")
    out = tmp_path / "emu.json"
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench.emulate_averaging", "--quick", "--out", str(out), "--logs", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:  # the bench cleans up on SIGTERM; then whatever is left of its group goes
            os.killpg(bench.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                bench.wait(30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(bench.pid, signal.SIGKILL)
            bench.wait(5)
    assert bench.returncode == 0, output
    [row] = json.loads(out.read_text())
    assert KEYS <= row.keys() and row["mode"] == "emu", row
    # every mode had a round whose result every peer checked against the true mean
    assert all(row[mode] is not None and row[mode] > 0 for mode in MODES), output
    assert row["lower_bound"] > 0
    # a failed attempt (then retried) must be one hivemind itself flagged, never a silently wrong mean
    assert all(kinds["wrong"] == 0 for kinds in row["failed_rounds"].values()), output
    assert set(row["tcp_congestion"]) == {"cubic"}, row["tcp_congestion"]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"dedloc-emu-{bench.pid}-" not in left
