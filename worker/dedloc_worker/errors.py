"""Errors of the worker, each mapped to one CLI exit code in ``cli.py``.

    WorkerError
    ├── ConfigError        the run or the command line names something that does not exist (exit 2)
    ├── PortalError        the portal is unreachable or refused the request (exit 3)
    ├── TrainingError      training stopped: a bad task, non-finite parameters (exit 4)
    ├── SwarmError         no peer of the run could be reached (exit 5)
    ├── AdmissionError     the run refused this worker: not signed in, banned, not allowlisted, limits (exit 6)
    └── ResourceError      the run's model does not fit this machine's free memory (exit 8)

A run that reached its target (or that its organizers ended) is no error: the worker leaves with exit code 7,
``RUN_FINISHED``, so scripts can tell "done" from "stopped".
"""

import asyncio

RUN_FINISHED = 7

# What a call into hivemind's DHT from one of the worker's threads can raise beyond Exception: its MPFuture passes on
# the coroutine's GeneratorExit or CancelledError (a 30-minute soak's relay watch died of a GeneratorExit). A thread
# that retries the DHT catches these; coroutines let cancellation through.
DHT_FAILURES = (Exception, GeneratorExit, asyncio.CancelledError)


class WorkerError(Exception):
    exit_code = 1


class ConfigError(WorkerError):
    exit_code = 2


class PortalError(WorkerError):
    exit_code = 3


class TrainingError(WorkerError):
    exit_code = 4


class SwarmError(WorkerError):
    exit_code = 5


class AdmissionError(WorkerError):
    exit_code = 6


class ResourceError(WorkerError):
    exit_code = 8


class RunFinished(WorkerError):
    """Not a failure: the run is over. The CLI prints the message and exits with ``RUN_FINISHED``."""

    exit_code = RUN_FINISHED
