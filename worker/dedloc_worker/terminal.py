"""A quiet terminal: hivemind's messages about expected events (a round that did not form, a part that arrived
late, a peer that left) become one line that says what happens next; its shutdown noise is dropped, and so is
torch's deprecation warning for what uint8 compression calls.
``--verbose`` keeps everything as hivemind writes it.

Installed before the DHT and the averagers start: their processes are forked from this one and inherit it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import warnings

BROKE_OFF = ("an averaging round broke off (a peer left or stopped answering); this step uses this peer's own "
             "gradients, and the next round tries again")
CALLED_OFF = ("an averaging round was called off before its group formed (this peer lost the network, or stopped "
              "waiting for it); this step uses this peer's own gradients, and the next round tries again")
NO_GROUP = ("no averaging group formed this round (the other peers were busy or gone); this step uses this "
            "peer's own gradients, and the next round tries again")
# A round that lost parts (a partial round), from the aggregator's side and from the sender's (\1: the percentage).
PART_LATE = r"an aggregated part got \1% of its senders' gradients in time; it averaged those"
RESULTS_LATE = r"\1% of the averaged gradient came back in time; the rest of this round used this peer's own gradient"
# Messages whose text says all there is to say about an expected event: (pattern, one line or None to drop).
EXPECTED = [
    (re.compile(r"Averaging step failed: could not find a group"), NO_GROUP),
    (re.compile(r"Another look_for_group is already in progress"), None),
    # a round cancelled as this peer leaves, then triggered by its step's background work: nothing to do
    (re.compile(r"^Trigger is already set$"), None),
    (re.compile(r"Reducer: received ([\d.]+)% of input tensors"), PART_LATE),
    (re.compile(r"Averaging: received ([\d.]+)% results"), RESULTS_LATE),
    (re.compile(r"Averager shutdown has no effect: the process is already not alive"), None),
    (re.compile(r"Failed to download state from \S+ - "),
     "could not download the training state from one peer (it left, or answered too slowly); asking another"),
]
# asyncio's complaints while hivemind's daemon connections close at exit, and its race when a scheduled round is
# cancelled as it finishes (a joiner that loaded state): nothing is lost, nothing to do.
SHUTDOWN_NOISE = re.compile(r"Task was destroyed but it is pending|cannot reuse already awaited coroutine|"
                            r"Unhandled exception in client_connected_cb|"
                            r"Can't set_result to a future that is CANCELLED")
# hivemind's uint8 compression calls torch.quantize_per_tensor, which torch 2.13 deprecates; it still works, and
# nothing a volunteer does would change it.
DEPRECATED_QUANTIZE = r"torch\.quantize_per_tensor"


def peer_failure(error: BaseException | None) -> bool:
    """Whether an averaging round failed because of the network or the other peers (one left, stopped answering or
    sent too little in time), as opposed to a fault in this code, which keeps its traceback."""
    import asyncio

    from hivemind.averaging.matchmaking import MatchmakingException
    from hivemind.averaging.partition import AllreduceException
    from hivemind.p2p import P2PDaemonError, P2PHandlerError

    # CancelledError: hivemind cut the round off at its averaging timeout (seen as a link went down mid-round)
    return isinstance(error, (TimeoutError, ConnectionError, EOFError, StopAsyncIteration, AllreduceException,
                              MatchmakingException, P2PDaemonError, P2PHandlerError, asyncio.CancelledError))


class ExpectedEvents(logging.Filter):
    """Rewrites expected events into one line, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], GeneratorExit):
            return False  # a DHT coroutine closed because its caller stopped waiting: nothing failed
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and str(error).startswith("Unable to run All-Reduce") and \
                peer_failure(error.__cause__ or error.__context__):  # hivemind's wrapper of what the round met
            return self._one_line(record, BROKE_OFF)
        if isinstance(error, asyncio.CancelledError) and not str(error):
            # hivemind's _step logs a round whose trigger was cancelled while it looked for a group as it is (seen as
            # a link went down: seed 11's soak)
            return self._one_line(record, CALLED_OFF)
        if record.exc_info and isinstance(record.exc_info[1], PermissionError):  # admission.Refused: doing its job
            return self._one_line(record, f"refused a call: {record.exc_info[1]}")
        message = record.getMessage()
        for pattern, line in EXPECTED:
            match = pattern.search(message)
            if match:
                if line is None:
                    return False
                return self._one_line(record, match.expand(line))
        return True

    @staticmethod
    def _one_line(record: logging.LogRecord, line: str) -> bool:
        record.msg, record.args = line, ()
        record.exc_info = record.exc_text = record.stack_info = None
        record.levelno, record.levelname = logging.WARNING, "WARN"
        return True


# A task or future that failed because a peer's connection did, or was cut off with its round at the round's
# timeout: hivemind's writer of a stream whose reader already gave up (a link went down mid-round); the round's
# failure is said once, by the round.
NEVER_RETRIEVED = re.compile(r"^(Task|Future) exception was never retrieved")


class ShutdownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and NEVER_RETRIEVED.search(str(record.msg)) and peer_failure(error):
            return False
        text = record.getMessage() + str(error or "")
        return SHUTDOWN_NOISE.search(text) is None


def quiet(verbose: bool = False) -> None:
    """Install the filters on hivemind's log handler and on asyncio's logger; ``verbose`` installs nothing."""
    if verbose:
        return
    warnings.filterwarnings("ignore", message=DEPRECATED_QUANTIZE, category=UserWarning)
    from hivemind.utils.logging import get_logger

    get_logger("hivemind")  # hivemind creates its handler on first use
    handlers = logging.getLogger("hivemind").handlers or logging.getLogger().handlers
    for handler in handlers:
        if not any(isinstance(f, ExpectedEvents) for f in handler.filters):
            handler.addFilter(ExpectedEvents())
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, ShutdownNoise) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(ShutdownNoise())
