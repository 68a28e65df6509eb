"""The admission keeper: the main-process thread that keeps this peer's token fresh (``admission.renewal``), the run's
denylist in force (from the DHT, the portal, or kept), and the set of admitted PeerIDs current for the handlers that
``admission.gate.guard_handlers`` wraps."""

from __future__ import annotations

import functools
import threading
import time
from typing import Callable, Optional

from dedloc_common.contract import PeerToken

from dedloc_worker.admission.gate import (
    AdmissionState,
    Refused,
    TokenCheck,
    admitted_peers,
    parse_expiration,
    to_access_token,
)
from dedloc_worker.errors import DHT_FAILURES

RECALL_EVERY = 15  # keeper rounds between two calls to the run's coordinators (and republishing the denylist)
# Keeper rounds between two reads of the DHT's tokens and denylist, unless a handler met an unknown caller: each
# read is signed RPCs to every node holding the records, on CPU the training shares (docs/benchmarks.md).
READ_EVERY = 5
# Seconds between two reads of the portal's signed denylist: a ban reaches peers while no coordinator is up.
PORTAL_INTERVAL = 5.0


class AdmissionKeeper(threading.Thread):
    """Main-process thread: keeps this peer's token fresh and the admitted set current.

    :param refresh: returns a new ``PeerToken`` (asks the portal, or signs locally on the coordinator); raises
        with a reason in words when the run refuses
    :param stop: set when the run refuses this peer (``failure`` says why), so training ends

    ``expired`` is set while this peer's token has expired and the portal could not renew it: peers refuse the
    token, so the training loop trains nothing until a new one clears it.
    :param portal_denylist: returns the run's signed denylist as the portal has it (``contract.SignedDenylist``
        fields), raising ``WorkerError`` when the portal cannot be reached
    :param interval: seconds between two rounds. The DHT's tokens are read every ``READ_EVERY`` rounds, and in
        the next round after a handler met a caller it did not know (``AdmissionState.want``): a newcomer's
        all-reduce parts wait that long at most for admission, and hivemind's round fails if they wait too long.
        This peer's token is stored when it changes and every third of its record's lifetime.
    """

    def __init__(self, dht, run_id: str, state: AdmissionState, check: TokenCheck, signature,
                 refresh: Callable[[], PeerToken], stop: threading.Event, interval: float = 1.0,
                 coordinators: Optional[Callable[[], list[str]]] = None,
                 portal_denylist: Optional[Callable[[], dict]] = None, say: Optional[Callable[[str], None]] = None):
        super().__init__(name="dedloc-admission", daemon=True)
        self.dht, self.run_id, self.state, self.check, self.signature = dht, run_id, state, check, signature
        self.refresh, self.stop, self.interval = refresh, stop, interval
        self.failure: Optional[str] = None
        self.halted = threading.Event()
        self.expired = threading.Event()
        self.ready = threading.Event()  # set once this peer's token is published and the admitted set written
        # Every RECALL_EVERY rounds, call the run's coordinators: one that restarted is in nobody's routing table.
        # In between, every round while this peer's DHT knows no peer (its network was down), call them again.
        self.coordinators, self.rounds = coordinators, 0
        self.coordinator_addrs: Optional[list[str]] = None  # as the portal listed them last
        self.alone_since: Optional[float] = None  # when this peer's DHT was first seen to know no peer
        from dedloc_worker.admission.renewal import TokenRenewal

        self.say = say or (lambda line: print(line, flush=True))
        self.token = state.read_token()
        self.renewal = TokenRenewal(time.time(), parse_expiration(self.token.expiration_time), self.say)
        # The newest authentic denylist seen (records.DenylistRecord): in force until a newer one replaces it.
        self.denylist, self.portal_denylist, self.portal_asked = None, portal_denylist, -PORTAL_INTERVAL

    def run(self) -> None:
        from dedloc_worker.swarm.records import TOKEN_RECORD_TTL, publish_token, read_tokens

        published, wanted = (None, float("-inf")), None  # (token stored, when); the handlers' last request
        while not self.halted.is_set():
            try:
                self._refresh_if_needed()
                if published[0] is not self.token or time.monotonic() - published[1] >= TOKEN_RECORD_TTL / 3:
                    publish_token(self.dht, self.run_id, self.signature, self.token)
                    published = (self.token, time.monotonic())
                asked = self.state.wanted()
                if self.rounds % READ_EVERY == 0 or asked != wanted or self._portal_due():
                    wanted = asked
                    denied = self._current_denylist()
                    if self.token.username in denied:
                        raise Refused(f"{self.token.username} was banned from this run by its organizers")
                    tokens = read_tokens(self.dht, self.run_id)
                    self.state.write_admitted(admitted_peers(tokens, self.check, frozenset(denied)), denied)
                self.ready.set()
                self.rounds += 1
                if self.coordinators is not None:
                    self._keep_in_touch()
            except Refused as e:
                self.failure = str(e)
                self.stop.set()
                return
            except DHT_FAILURES as e:  # the DHT or the portal briefly unavailable: keep what we have, retry
                if not self.halted.is_set():
                    print(f"admission: {type(e).__name__}: {e}; retrying", flush=True)
            self.halted.wait(self.interval)

    def halt(self, timeout: float = 10.0) -> None:
        """Stop before the DHT shuts down (the thread uses it); wait at most ``timeout`` seconds."""
        self.halted.set()
        self.join(timeout=timeout)

    def _refresh_if_needed(self) -> None:
        """Ask for a new token at half-life; while the portal cannot be reached, train on and ask again later
        (``admission.renewal.TokenRenewal``). The run's refusal stops this peer; an expired token holds its training
        (``expired``) until the portal answers."""
        from dedloc_worker.admission.renewal import EXPIRED_RETRY_SECONDS
        from dedloc_worker.errors import AdmissionError

        now = time.time()
        if not self.renewal.due(now):
            return
        try:
            token = to_access_token(self.refresh())
        except (Refused, AdmissionError) as e:  # the run said no: a ban, a revoked sign-in
            raise Refused(str(e)) from e
        except Exception as e:  # the portal unreachable or failing
            if not self.renewal.failed(e, now) and not self.expired.is_set():
                self.expired.set()
                self.say(f"this peer's token expired and the portal cannot renew it ({e}): peers refuse an expired "
                         f"token, so training holds; asking the portal every {EXPIRED_RETRY_SECONDS:.0f} s, and "
                         "training resumes once it answers")
            return
        self.token = token
        self.renewal.renewed(time.time(), parse_expiration(token.expiration_time))
        self.state.write_token(self.token)
        self.expired.clear()

    def _portal_due(self) -> bool:
        """Time to ask the portal for its denylist (every ``PORTAL_INTERVAL`` s): bans placed while no coordinator is
        up reach peers that way."""
        return self.portal_denylist is not None and time.monotonic() - self.portal_asked >= PORTAL_INTERVAL

    def _current_denylist(self) -> list[str]:
        """Banned usernames from the newest authentic denylist seen: in the DHT (the coordinator's, or a peer's
        copy), from the portal (every ``PORTAL_INTERVAL`` seconds), or kept from before. It stays in force while its
        sources are quiet, and this peer republishes it under its own key, so it outlives a coordinator's outage
        and newcomers learn it (docs/architecture.md#outages)."""
        from dedloc_worker.errors import WorkerError
        from dedloc_worker.swarm.records import authentic_denylist, newest_denylist, publish_denylist

        in_dht = newest_denylist(self.dht, self.run_id, self.check)
        found = [self.denylist, in_dht]
        if self._portal_due():
            self.portal_asked = time.monotonic()
            try:
                found.append(authentic_denylist(self.portal_denylist(), self.check))
            except WorkerError:
                pass  # the portal down: what the DHT and this peer hold stays in force
        newest = max((d for d in found if d is not None), key=lambda d: d.issued_at, default=None)
        if newest is None:
            return []
        if self.denylist is not None and newest.issued_at > self.denylist.issued_at:
            for name in sorted(set(newest.usernames) - set(self.denylist.usernames) - {self.token.username}):
                self.say(f"{name} was banned from this run by its organizers: refused from now on")
        self.denylist = newest
        # The portal signs its list afresh at each request: a newer issue of the same names is no news to the DHT.
        if in_dht is None or set(in_dht.usernames) != set(newest.usernames) or self.rounds % RECALL_EVERY == 0:
            publish_denylist(self.dht, self.run_id, self.signature, newest.dict())
        return list(newest.usernames)

    def _keep_in_touch(self) -> None:
        """Call the run's coordinators every ``RECALL_EVERY`` rounds (asking the portal where they are), and every
        round while this peer's DHT knows no peer (seen within ``READ_EVERY`` rounds). A peer whose link was down
        knows none once it is back: each call that failed meanwhile dropped its callee from the routing table, and a
        client-mode peer is in nobody's table, so nobody calls it; until one of its own calls reaches a peer it
        trains alone, uncredited."""
        from dedloc_worker.errors import WorkerError
        from dedloc_worker.swarm.node import rejoin

        due = self.rounds % RECALL_EVERY == 0
        # Whether the DHT knows no peer is a request to the DHT process, on CPU the training shares: looked at every
        # READ_EVERY rounds, and every round once it knew none.
        if not (due or self.alone_since is not None or self.rounds % READ_EVERY == 0):
            return
        if due or self.coordinator_addrs is None:
            try:
                self.coordinator_addrs = self.coordinators()
            except WorkerError:
                pass  # the portal down: the coordinators it listed last are called, and it is asked again later
        if not self.coordinator_addrs:
            return
        alone, reached = self.dht.run_coroutine(functools.partial(rejoin, addrs=self.coordinator_addrs, always=due))
        if alone and not reached and self.alone_since is None:
            self.alone_since = time.monotonic()
            self.say("lost touch with the swarm: no peer answers (is the network down?); training alone and calling "
                     "the run's coordinators every second until one answers")
        elif reached and self.alone_since is not None:
            self.say(f"back in touch with the swarm: the run's coordinator answered after "
                     f"{time.monotonic() - self.alone_since:.0f} s alone; training with the others again")
            self.alone_since = None
