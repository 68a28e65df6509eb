"""The quiet terminal (dedloc_worker.terminal): an averaging round that broke off because of the peers is one line;
one that broke off because of a fault in our code keeps its traceback. Real hivemind exceptions, a real handler."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import io
import logging
import subprocess
import sys

import pytest
from dedloc_worker.terminal import BROKE_OFF, CALLED_OFF, ExpectedEvents, ShutdownNoise
from hivemind.averaging.matchmaking import MatchmakingException


def logged(inner: BaseException) -> str:
    """What hivemind's averager writes when a round fails with ``inner``, through the worker's filter."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(ExpectedEvents())
    logger = logging.getLogger(f"test-terminal-{id(inner)}")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            raise inner
        except BaseException as e:  # as in hivemind's _aggregate_with_group, then its _step
            raise MatchmakingException(f"Unable to run All-Reduce: {e}")  # noqa: B904 (as hivemind raises it)
    except MatchmakingException as wrapped:
        logger.exception(wrapped)
    return out.getvalue()


@pytest.mark.parametrize("inner", [asyncio.TimeoutError(), ConnectionResetError("reset by peer"),
                                   asyncio.IncompleteReadError(b"", 8), asyncio.CancelledError()])
def test_a_round_a_peer_broke_off_is_one_line(inner):
    text = logged(inner)
    assert text.strip() == BROKE_OFF and "Traceback" not in text


def test_a_round_called_off_before_its_group_formed_is_one_line():
    """hivemind's _step logs the CancelledError of a round whose trigger was cancelled while it looked for a group
    as it is, not wrapped (seed 11's soak, as a link went down)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(ExpectedEvents())
    logger = logging.getLogger("test-terminal-called-off")
    logger.addHandler(handler)
    logger.propagate = False
    for error in (asyncio.CancelledError(), ValueError("a fault of ours")):  # the second: control, keeps its traceback
        try:
            try:
                raise concurrent.futures.CancelledError()  # hivemind's MPFuture, cancelled
            except concurrent.futures.CancelledError:
                raise error  # noqa: B904 (as hivemind's MPFuture.__await__ raises it)
        except (asyncio.CancelledError, ValueError) as e:
            logger.exception(e)
    lines = out.getvalue()
    assert lines.startswith(CALLED_OFF + "\n") and lines.count("Traceback") == 2  # the control's (both chained)
    assert "ValueError: a fault of ours" in lines


def test_a_round_our_code_broke_keeps_its_traceback():
    text = logged(TypeError("unsupported operand type(s)"))
    assert "Traceback" in text and "TypeError: unsupported operand" in text and BROKE_OFF not in text


def never_retrieved(error: BaseException) -> str:
    """What asyncio logs for a task that failed with ``error`` and that nobody awaited, through the worker's filter."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(ShutdownNoise())
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)

    async def write_to_stream():  # as hivemind's writer of a stream whose reader has already given up
        raise error

    async def main():
        asyncio.get_running_loop().create_task(write_to_stream())
        await asyncio.sleep(0.01)

    try:
        asyncio.run(main())  # the task is dropped unretrieved; asyncio reports it as the task is freed
        gc.collect()
    finally:
        logger.removeHandler(handler)
    return out.getvalue()


def test_a_stream_writer_that_lost_its_peer_is_not_reported_but_a_fault_is():
    # seen in tests/test_reachability_netns.py as the link went down: "Task exception was never retrieved ...
    # exception=ConnectionResetError('Connection lost')" and its traceback
    assert never_retrieved(ConnectionResetError("Connection lost")) == ""
    text = never_retrieved(TypeError("a fault in our code"))
    assert "Task exception was never retrieved" in text and "TypeError: a fault in our code" in text


# A fresh process each: torch says this warning once per process.
QUANTIZE = """
import sys, torch
from dedloc_worker.terminal import quiet
from hivemind.compression import CompressionInfo, Uniform8BitQuantization
quiet(verbose=sys.argv[1] == "verbose")
gradient = torch.randn(1000)
print(len(Uniform8BitQuantization().compress(gradient, CompressionInfo.from_tensor(gradient)).buffer))
"""


def uint8_terminal(mode: str) -> tuple[str, str]:
    """What a worker's process prints as hivemind's uint8 compression compresses a gradient: (stdout, stderr)."""
    done = subprocess.run([sys.executable, "-c", QUANTIZE, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


def test_uint8_compression_deprecation_is_not_shown_unless_verbose():
    _, verbose = uint8_terminal("verbose")
    assert "quantize_per_tensor" in verbose  # control: torch 2.13 warns
    compressed, quiet = uint8_terminal("quiet")
    assert int(compressed) > 1000 and "quantize_per_tensor" not in quiet  # it still compressed, silently
