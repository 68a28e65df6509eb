"""The DHT process's end of its request pipe (``dedloc_worker.swarm.node._StaleRequestsDropped``) reads whole
requests even where the pipe was made non-blocking: a soak run's worker lost its DHT process to a request read
halfway (EAGAIN, then a read that began mid-message)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading

import pytest
from dedloc_worker.swarm.node import _StaleRequestsDropped

REQUEST = ("_store", [b"x" * 20_000_000], {})  # far larger than a socket's buffer: it arrives in many writes


def send_quietly(end) -> None:
    with contextlib.suppress(OSError):  # the control closes its end mid-request
        end.send(REQUEST)


def sent_on_a_non_blocking_pipe():
    ours, theirs = multiprocessing.Pipe()
    os.set_blocking(ours.fileno(), False)
    sender = threading.Thread(target=send_quietly, args=(theirs,), daemon=True)
    sender.start()
    assert ours.poll(10)  # the request has begun to arrive, as when the DHT's loop reads it
    return ours, sender


def test_a_request_still_arriving_is_read_whole():
    ours, sender = sent_on_a_non_blocking_pipe()
    assert _StaleRequestsDropped(ours).recv() == REQUEST
    sender.join(10)


def test_the_control_a_bare_non_blocking_read_breaks_off_halfway():
    ours, sender = sent_on_a_non_blocking_pipe()
    with pytest.raises(BlockingIOError):
        ours.recv()
    ours.close()  # the sender's write then fails, and it ends
    sender.join(10)
    assert not sender.is_alive()
