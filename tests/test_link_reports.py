"""A worker's link report: its portal link re-measured in a thread of its own, and what its rounds achieved."""

from __future__ import annotations

import threading
import time

import pytest
from dedloc_common.contract import LinkReport
from dedloc_worker.averaging.planned import RoundOutcome, Transfers
from dedloc_worker.averaging.planning import LinkMeter, PlanFollower, link_report


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


class Measurements:
    """What the portal probe answers, one figure after the other: (upload, download), None (unreachable) or an
    exception; the last one repeats."""

    def __init__(self, *answers):
        self.answers, self.lock, self.given = list(answers), threading.Lock(), 0

    def __call__(self):
        with self.lock:
            answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
            self.given += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_due_measurement_starts_when_a_round_ends_and_failures_keep_the_last_figures():
    clock = iter(float(t) for t in range(1000, 2000))
    probe = Measurements((1e6, 2e6), None, OSError("portal down"), (3e6, 4e6))
    meter = LinkMeter(probe, interval=0.05, quiet_wait=30.0, clock=lambda: next(clock))
    meter.start()
    try:
        time.sleep(0.3)
        assert meter.latest is None, "due, but no round has ended: it waits (up to quiet_wait)"
        meter.round_ended()
        assert wait_until(lambda: meter.latest is not None)
        first = meter.latest
        assert first[:2] == (1e6, 2e6) and first[2] >= 1000.0
        for answered in (2, 3):  # the portal unreachable, then the probe failing: the figures stay
            assert wait_until(lambda: (meter.round_ended(), probe.given >= answered)[1])
            time.sleep(0.1)
            assert meter.latest == first
        assert wait_until(lambda: (meter.round_ended(), meter.latest)[1][:2] == (3e6, 4e6))
        assert meter.latest[2] > first[2]
    finally:
        meter.halt(timeout=5)
    assert not meter.is_alive()


def test_without_rounds_a_due_measurement_waits_quiet_wait_at_most():
    meter = LinkMeter(Measurements((5e6, 6e6)), interval=0.05, quiet_wait=0.3)
    began = time.monotonic()
    meter.start()
    try:
        assert wait_until(lambda: meter.latest is not None, timeout=10)
        assert time.monotonic() - began >= 0.3
        assert meter.latest[:2] == (5e6, 6e6)
    finally:
        meter.halt(timeout=5)


def test_halting_a_meter_waiting_for_a_round_ends_it_at_once():
    meter = LinkMeter(Measurements((1e6, 1e6)), interval=0.01, quiet_wait=60.0)
    meter.start()
    time.sleep(0.1)
    began = time.monotonic()
    meter.halt(timeout=5)
    assert not meter.is_alive() and time.monotonic() - began < 2 and meter.latest is None


class Averager:
    """The gradient averager as the follower uses it, holding the outcome of its last round."""

    peer_id = "12D3KooWPeer"

    def __init__(self, last=None):
        self.last, self.shares, self.bits = last, None, None
        self.running = None  # a round under way, which last_round returns and finished_round does not


    def set_plan(self, shares):
        self.shares = shares

    def set_group_bits(self, bits, wait=True):
        self.bits = bits

    def last_round(self, timeout=None):
        return self.running or self.last

    def finished_round(self, timeout=None):
        return self.last


def outcome(sent: int, received: int, began: float, ended: float, **changes) -> RoundOutcome:
    return RoundOutcome(peer_ids=[Averager.peer_id, "12D3KooWOther"], fractions=[0.5, 0.5], planned=True,
                        total_elements=1000, aggregated_elements=500, began=began, ended=ended,
                        transfers=Transfers(sent=sent, received=received), **changes)


def test_after_each_epoch_the_report_carries_the_last_complete_round_and_the_newest_measurement():
    joined = LinkReport(upload_bps=1e6, download_bps=2e6, measured_at=100.0, vector_bytes=4000)
    meter = LinkMeter(Measurements((0.0, 0.0)))  # not started: its figures are set by hand below
    follower = PlanFollower(None, "run", None, joined, meter=meter)
    averager = Averager(outcome(6000, 6000, began=200.0, ended=200.5))

    link = follower.after_epoch(averager)
    assert (link.round_sent_bytes, link.round_received_bytes, link.round_seconds, link.round_ended) == (
        6000, 6000, 0.5, 200.5)
    assert (link.upload_bps, link.download_bps, link.measured_at) == (1e6, 2e6, 100.0)  # no newer measurement
    assert meter._round_ended.is_set(), "the round's end lets a due measurement start"

    meter.latest = (7e6, 8e6, 300.0)
    averager.running = outcome(100, 200, began=310.0, ended=0.0)  # a round under way: nothing failed, nothing ended
    link = follower.after_epoch(averager)
    assert (link.upload_bps, link.download_bps, link.measured_at) == (7e6, 8e6, 300.0)
    assert (link.round_sent_bytes, link.round_ended) == (6000, 200.5), "the last finished round's figures stay"

    averager.last = outcome(9000, 9000, began=320.0, ended=321.0, failed_elements=10)  # incomplete: not reported
    meter.latest = (9e6, 9e6, 250.0)  # older than the figures in the report: ignored
    link = follower.after_epoch(averager)
    assert (link.round_sent_bytes, link.upload_bps, link.measured_at) == (6000, 7e6, 300.0)
    # what the coordinator reads: the record's link, round-tripped through its schema
    assert LinkReport.parse_obj(link.dict()) == link


def test_the_first_report_dates_its_measurement_and_a_failed_one_says_so():
    params = []
    measured = link_report((1e6, 2e6), params, client_mode=False, aux=False, measured_at=123.0)
    assert (measured.upload_bps, measured.download_bps, measured.measured_at) == (1e6, 2e6, 123.0)
    unmeasured = link_report(None, params, client_mode=True, aux=False)
    assert (unmeasured.upload_bps, unmeasured.measured_at, unmeasured.client_mode) == (0.0, 0.0, True)


# hivemind's 8-bit quantization calls torch.quantize_per_tensor, deprecated in torch 2.13 (it still works)
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_the_reported_vector_is_the_gradients_size_on_the_wire_under_the_runs_compression():
    import torch
    from dedloc_common.contract import OptimizerOptions
    from dedloc_worker.training.options import gradient_compression
    from hivemind.compression import CompressionInfo

    elements = 131072  # a 128 KiB part at one byte an element
    params = [torch.nn.Parameter(torch.randn(elements)), torch.nn.Parameter(torch.randn(100), requires_grad=False)]
    gradient = torch.randn(elements)
    for compression in OptimizerOptions.model_fields["compression"].annotation.__args__:
        reported = link_report(None, params, client_mode=False, aux=False, compression=compression).vector_bytes
        codec = gradient_compression(OptimizerOptions(compression=compression))
        sent = len(codec.compress(gradient, CompressionInfo.from_tensor(gradient)).buffer)
        assert abs(reported - sent) / sent < 0.01, (compression, reported, sent)
