"""Errors of the portal and coordinator, mapped to HTTP in ``app/web/main.py`` and to exit codes in
``app/cli/main.py``.

    DedlocError
    ├── NotFound       a run (or other object) that does not exist (HTTP 404, exit 2)
    ├── Invalid        input that breaks a rule, e.g. a slug already taken (HTTP 422, exit 2)
    ├── Forbidden      a user the run does not admit: banned, not allowlisted (HTTP 403, exit 2)
    ├── TooLarge       a request body past its limit, e.g. an oversize link probe (HTTP 413)
    ├── TooManyRequests  past a per-account limit; says when to retry (HTTP 429 + Retry-After)
    └── Unavailable    past a capacity limit of this process, e.g. live streams (HTTP 503 + Retry-After)
"""


class DedlocError(Exception):
    status_code = 400
    exit_code = 1


class NotFound(DedlocError):
    status_code = 404
    exit_code = 2


class Invalid(DedlocError):
    status_code = 422
    exit_code = 2


class Forbidden(DedlocError):
    status_code = 403
    exit_code = 2


class TooLarge(DedlocError):
    status_code = 413


class TooManyRequests(DedlocError):
    status_code = 429

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(TooManyRequests):
    status_code = 503
