"""Talking to the portal over HTTP: the only place the worker does."""

from __future__ import annotations

import functools
import os
import ssl
import threading
import time
from pathlib import Path

import httpx
import pydantic
from dedloc_common.contract import (
    API_PREFIX,
    JoinInfo,
    PeerTokenGrant,
    PeerTokenRequest,
    ReachabilityReport,
    SignedDenylist,
)

from dedloc_worker.errors import AdmissionError, ConfigError, PortalError, WorkerError


@functools.lru_cache(maxsize=None)
def tls() -> ssl.SSLContext:
    """One TLS context per process, as httpx would build it: building one loads the CA bundle (40-160 ms of CPU
    here), and the keepers ask the portal every few seconds (docs/benchmarks.md#where-a-swarm-spends-its-cpu)."""
    return httpx.create_ssl_context()


def fetch_join_info(portal_url: str, slug: str, transport: httpx.BaseTransport | None = None) -> JoinInfo:
    """The run's config and initial peers; ``ConfigError`` for an unknown run, ``PortalError`` otherwise."""
    url = f"{portal_url.rstrip('/')}{API_PREFIX}/runs/{slug}/join"
    try:
        with httpx.Client(transport=transport, verify=tls(), timeout=10) as client:
            response = client.get(url)
    except httpx.HTTPError as e:
        raise PortalError(f"cannot reach the portal at {portal_url} ({e}); check the address and your network") from e
    if response.status_code == 404:
        raise ConfigError(f"the portal at {portal_url} has no run named {slug!r}; check the run's join page")
    if response.status_code != 200:
        raise PortalError(f"the portal answered {response.status_code} for {url}: {response.text[:200]}")
    try:
        return JoinInfo.model_validate_json(response.content)
    except pydantic.ValidationError as e:
        raise PortalError("the portal sent a run config this worker does not understand; upgrade dedloc-worker "
                          f"({e})") from e


def wait_for_peers(portal_url: str, slug: str, wait_seconds: float, say=None, first_delay: float = 1.0,
                   max_delay: float = 30.0) -> JoinInfo:
    """Fetch join info until the run has a coordinator online, for at most ``wait_seconds``, asking again after
    ``first_delay`` seconds, then twice as long each time up to ``max_delay``: one line to the user per try."""
    say = say or (lambda line: print(line, flush=True))
    deadline = time.monotonic() + wait_seconds
    delay = first_delay
    info, why = _join_info_or_reason(portal_url, slug)
    while info is None or not info.initial_peers:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PortalError(f"{why}; gave up after {wait_seconds:.0f} s (--wait): retry later")
        say(f"{why}; asking again in {min(delay, left):.0f} s")
        time.sleep(min(delay, left))
        delay = min(2 * delay, max_delay)
        info, why = _join_info_or_reason(portal_url, slug)
    return info


def _join_info_or_reason(portal_url: str, slug: str) -> tuple[JoinInfo | None, str]:
    """Join info, or None with why not (an unreachable portal is waited out like a coordinator that is down)."""
    try:
        info = fetch_join_info(portal_url, slug)
    except PortalError as e:
        return None, str(e)
    return info, info.notice or f"run {slug!r} has no coordinator online"


def request_peer_token(portal_url: str, slug: str, credential: str, public_key: bytes,
                       transport: httpx.BaseTransport | None = None) -> PeerTokenGrant:
    """A peer token for this process's key; ``AdmissionError`` with the portal's reason when refused."""
    url = f"{portal_url.rstrip('/')}{API_PREFIX}/runs/{slug}/peer-tokens"
    body = PeerTokenRequest(public_key=public_key.decode()).model_dump()
    try:
        with httpx.Client(transport=transport, verify=tls(), timeout=15) as client:
            response = client.post(url, json=body, headers={"Authorization": f"Bearer {credential}"})
    except httpx.HTTPError as e:
        raise PortalError(f"cannot reach the portal at {portal_url} ({e}); check the address and your network") from e
    if response.status_code == 401:
        raise AdmissionError(f"the portal no longer accepts this machine's sign-in; run "
                             f"`dedloc-worker login {portal_url}` again")
    if response.status_code == 404:
        raise ConfigError(f"the portal at {portal_url} has no run named {slug!r}; check the run's join page")
    if response.status_code in (403, 429):
        raise AdmissionError(f"run {slug!r} refused this worker: {_reason(response)}")
    if response.status_code != 200:
        raise PortalError(f"the portal answered {response.status_code} for {url}: {response.text[:200]}")
    return PeerTokenGrant.model_validate_json(response.content)


def fetch_denylist(portal_url: str, slug: str, credential: str,
                   transport: httpx.BaseTransport | None = None) -> SignedDenylist:
    """The run's denylist as the portal signs it now; ``PortalError`` when it cannot be had."""
    url = f"{portal_url.rstrip('/')}{API_PREFIX}/runs/{slug}/denylist"
    try:
        with httpx.Client(transport=transport, verify=tls(), timeout=10) as client:
            response = client.get(url, headers={"Authorization": f"Bearer {credential}"})
        response.raise_for_status()
        return SignedDenylist.model_validate_json(response.content)
    except (httpx.HTTPError, pydantic.ValidationError) as e:
        raise PortalError(f"cannot read run {slug!r}'s denylist from the portal ({e})") from None


def _reason(response: httpx.Response) -> str:
    try:
        return str(response.json()["detail"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def measure_link(portal_url: str, slug: str, credential: str, size: int = 4 * 1024 * 1024, repeats: int = 2,
                 transport: httpx.BaseTransport | None = None) -> tuple[float, float] | None:
    """(upload, download) in bytes per second, timed transfers of ``size`` bytes to and from the portal, best of
    ``repeats``; None when the portal cannot be probed (the planner then leaves this peer to hivemind's split)."""
    url = f"{portal_url.rstrip('/')}{API_PREFIX}/runs/{slug}/link-probe"
    headers = {"Authorization": f"Bearer {credential}"}
    payload = os.urandom(size)  # incompressible, whatever the transport does
    upload = download = 0.0
    try:
        with httpx.Client(transport=transport, verify=tls(), timeout=60, headers=headers) as client:
            for _ in range(repeats):
                began = time.perf_counter()
                client.post(url, content=payload).raise_for_status()
                upload = max(upload, size / (time.perf_counter() - began))
                began = time.perf_counter()
                received = len(client.get(url, params={"size": size}).raise_for_status().content)
                download = max(download, received / (time.perf_counter() - began))
    except httpx.HTTPError:
        return None
    return upload, download


# Seconds between the dial-back requests while the portal cannot be reached (a restart): a verdict taken then would
# leave a peer behind NAT a full peer that nobody can reach (the soak bench saw two such in four portal restarts)
REACHABILITY_RETRIES = (2.0, 4.0, 8.0, 16.0)


def check_reachability(portal_url: str, slug: str, credential: str, addrs: list[str],
                       transport: httpx.BaseTransport | None = None,
                       retries: tuple[float, ...] = REACHABILITY_RETRIES,
                       say=lambda line: print(line, flush=True)) -> ReachabilityReport | None:
    """The portal's dial-back of ``addrs`` (can peers connect to this machine?); None when it cannot tell. While the
    portal cannot be reached, or answers 5xx, asks again after each of ``retries`` seconds, one line each."""
    url = f"{portal_url.rstrip('/')}{API_PREFIX}/runs/{slug}/reachability"
    for wait in (*retries, None):
        try:
            with httpx.Client(transport=transport, verify=tls(), timeout=30) as client:
                response = client.post(url, json={"addrs": addrs[:16]},
                                       headers={"Authorization": f"Bearer {credential}"})
            if response.status_code < 500:
                response.raise_for_status()
                return ReachabilityReport.model_validate_json(response.content)
            why = f"it answered {response.status_code}"
        except httpx.TransportError as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        except (httpx.HTTPError, pydantic.ValidationError):
            return None
        if wait is None:
            return None
        say(f"reachability: the portal cannot dial this machine back now ({why}); asking again in {wait:.0f} s")
        time.sleep(wait)
    return None


class RunWatch(threading.Thread):
    """The run's state and target as the portal says them, asked every ``interval`` seconds: organizers pause,
    resume and end runs and move their target on the portal, and a worker follows within that time. An unreachable
    portal leaves them as they were."""

    def __init__(self, portal_url: str, slug: str, state: str = "active", interval: float = 10.0,
                 target_epochs=None):
        super().__init__(name="dedloc-run-watch", daemon=True)
        self.portal_url, self.slug, self.state, self.interval = portal_url, slug, state, interval
        self.target_epochs = target_epochs  # organizers may move the target while the run trains
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                config = fetch_join_info(self.portal_url, self.slug).config
            except WorkerError:
                continue
            self.state, self.target_epochs = config.state, config.target_epochs

    def halt(self, timeout: float = 0.0) -> None:
        self._halt.set()
        self.join(timeout=timeout)


def download_checkpoint(portal_url: str, checkpoint, folder) -> Path:
    """Download a checkpoint archive (its url may be relative to the portal) into ``folder``, checking its
    sha256; ``PortalError`` when that fails."""
    import hashlib
    from pathlib import Path

    target = Path(folder) / f"checkpoint-{checkpoint.epoch}.tar"
    digest = hashlib.sha256()
    try:
        with httpx.Client(verify=tls(), timeout=60, follow_redirects=True) as client, client.stream(
                "GET", httpx.URL(portal_url.rstrip("/") + "/").join(checkpoint.url)) as response:
            response.raise_for_status()
            with target.open("wb") as out:
                for chunk in response.iter_bytes(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
    except httpx.HTTPError as e:
        raise PortalError(f"cannot download the run's checkpoint ({e}); retry in a minute") from None
    if digest.hexdigest() != checkpoint.sha256:
        raise PortalError("the run's checkpoint arrived damaged (sha256 mismatch); retry")
    return target
