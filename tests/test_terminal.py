"""The quiet terminal (dedloc_worker.terminal): an averaging round that broke off because of the peers is one line;
one that broke off because of a fault in our code keeps its traceback. Real hivemind exceptions, a real handler."""

from __future__ import annotations

import asyncio
import io
import logging

import pytest
from dedloc_worker.terminal import BROKE_OFF, ExpectedEvents
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
            raise MatchmakingException(f"Unable to run All-Reduce: {e}")
    except MatchmakingException as wrapped:
        logger.exception(wrapped)
    return out.getvalue()


@pytest.mark.parametrize("inner", [asyncio.TimeoutError(), ConnectionResetError("reset by peer"),
                                   asyncio.IncompleteReadError(b"", 8), asyncio.CancelledError()])
def test_a_round_a_peer_broke_off_is_one_line(inner):
    text = logged(inner)
    assert text.strip() == BROKE_OFF and "Traceback" not in text


def test_a_round_our_code_broke_keeps_its_traceback():
    text = logged(TypeError("unsupported operand type(s)"))
    assert "Traceback" in text and "TypeError: unsupported operand" in text and BROKE_OFF not in text
