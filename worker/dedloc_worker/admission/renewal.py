"""When a worker asks the portal for a new peer token, and what it tells its user while none can be had.

A token is renewed at half-life. While the portal is unreachable the peer trains on with the token it holds and
asks again after 2, 4, 8... seconds (at most ``max_delay``, and at most half the time left, so tries come closer
together as expiry nears), one line per failed try with the time left. Past expiry peers refuse the token, so the
peer trains nothing (``admission.keeper``) and asks every ``EXPIRED_RETRY_SECONDS`` until the portal answers; it
trains again with the new token. A portal that answers "no" (a ban, a revoked sign-in) ends it at once.
"""

from __future__ import annotations

from typing import Callable, Optional

EXPIRED_RETRY_SECONDS = 10.0  # between two tries once the token has expired: the portal back, training resumes soon


class TokenRenewal:
    """The schedule of one peer's token renewals.

    :param issued: when the current token was received (seconds since the epoch)
    :param expires: when it expires (seconds since the epoch)
    :param first_delay: seconds before the first retry after a failed renewal; doubled after each failure
    :param max_delay: the longest wait between two retries, seconds
    """

    def __init__(self, issued: float, expires: float, say: Optional[Callable[[str], None]] = None,
                 first_delay: float = 2.0, max_delay: float = 60.0):
        self.say = say or (lambda line: print(line, flush=True))
        self.first_delay, self.max_delay = first_delay, max_delay
        self.failures = 0
        self.renewed(issued, expires)

    def renewed(self, issued: float, expires: float) -> None:
        """A new token arrived at ``issued``, valid until ``expires``."""
        if self.failures:
            self.say(f"the portal is back: peer token renewed (valid {expires - issued:.0f} s)")
        self.issued, self.expires = issued, expires
        self.next_try = issued + (expires - issued) / 2
        self.failures, self.delay = 0, self.first_delay

    def due(self, now: float) -> bool:
        return now >= self.next_try

    def failed(self, error: Exception, now: float) -> bool:
        """A renewal failed at ``now``; False once the token has expired (the peer must not train; the next try
        comes ``EXPIRED_RETRY_SECONDS`` later), else the next try is scheduled and the user told, in one line, how
        long the token still holds."""
        left = self.expires - now
        if left <= 0:
            self.failures += 1
            self.next_try = now + EXPIRED_RETRY_SECONDS
            return False
        self.failures += 1
        # Half the time left at most: tries come closer together as expiry nears, so a portal back late still helps.
        wait = max(min(self.delay, self.max_delay, left / 2), min(1.0, left))
        self.next_try, self.delay = now + wait, min(2 * self.delay, self.max_delay)
        self.say(f"cannot renew this peer's token ({error}); training goes on, the token expires in {left:.0f} s; "
                 f"asking again in {wait:.0f} s")
        return True
