"""When a worker asks the portal for a new peer token while the portal cannot be reached, and what it says."""

from __future__ import annotations

from dedloc_worker.admission.renewal import EXPIRED_RETRY_SECONDS, TokenRenewal


def test_tries_come_closer_as_expiry_nears_then_go_on_past_it_until_the_portal_answers():
    said: list[str] = []
    renewal = TokenRenewal(issued=0.0, expires=100.0, say=said.append)
    assert not renewal.due(49.0) and renewal.due(50.0)  # half-life

    tries, now = [], 50.0
    while renewal.failed(ConnectionError("refused"), now):
        tries.append(renewal.next_try - now)
        now = renewal.next_try
    # 2, 4, 8... s, then at most half the time left, at least a second, until the token has expired
    assert tries[:3] == [2.0, 4.0, 8.0] and now >= 100.0
    assert all(later <= max(earlier, 1.0) for earlier, later in zip(tries[3:], tries[4:])), tries
    assert len(said) == len(tries) and all("training goes on, the token expires in" in line for line in said)

    # Expired: no line from here (the keeper says it once), and a try every EXPIRED_RETRY_SECONDS
    assert not renewal.failed(ConnectionError("refused"), now + 1)
    assert renewal.next_try == now + 1 + EXPIRED_RETRY_SECONDS and len(said) == len(tries)
    renewal.renewed(issued=now + 11, expires=now + 111)
    assert said[-1] == "the portal is back: peer token renewed (valid 100 s)"
    assert renewal.next_try == now + 61 and renewal.failures == 0
