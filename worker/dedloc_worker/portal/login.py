"""Device login (OAuth 2.0 device authorization grant, RFC 8628) and the credentials it stores.

The worker asks the portal for a code, prints it with the address where its user approves it, and polls until
the portal hands over an API credential. Credentials live in ``$XDG_CONFIG_HOME/dedloc/credentials.json``
(``~/.config`` by default), one per portal address, readable by their owner only (mode 0600).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import httpx
from dedloc_common.contract import API_PREFIX

from dedloc_worker import __version__
from dedloc_worker.errors import ConfigError, PortalError
from dedloc_worker.portal.client import tls

DEVICE_GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"
CLIENT_ID = "dedloc-worker"


@dataclass(frozen=True)
class Credential:
    """An API credential of one portal.

    :param portal_url: the portal's address, without a trailing slash
    :param access_token: the bearer secret, sent as ``Authorization: Bearer ...``
    :param username: whom the portal issued it to
    """

    portal_url: str
    access_token: str
    username: str


def portal_key(portal_url: str) -> str:
    return portal_url.strip().rstrip("/")


def device_login(portal_url: str, say: Callable[[str], object] = print,
                 transport: Optional[httpx.BaseTransport] = None, *,
                 sleep: Callable[[float], object] = time.sleep) -> Credential:
    """Log in through the browser: print a code and an address, wait until the user approves it there.

    Polls every ``interval`` seconds as the portal asks, 5 s more after each ``slow_down``. ``PortalError``
    with the reason in one line when the login is denied, expires, or its code was already used.
    """
    base = portal_key(portal_url)
    with httpx.Client(transport=transport, verify=tls(), timeout=30) as client:
        # Shown to the person approving, so they can tell their own worker from someone else's request.
        client_name = f"dedloc-worker {__version__} on {socket.gethostname()}"
        started = _post(client, base, "/device/code", {"client_id": CLIENT_ID, "client_name": client_name})
        if "device_code" not in started:
            raise PortalError(f"the portal at {base} cannot start a device login: {_reason(started)}")
        say(f"To log this worker in, open {started['verification_uri']} and enter the code {started['user_code']}")
        say(f"(or open {started['verification_uri_complete']}); waiting for your approval...")
        interval, waited = float(started.get("interval", 5)), 0.0
        while True:
            sleep(interval)
            waited += interval
            answer = _post(client, base, "/device/token", {
                "grant_type": DEVICE_GRANT_TYPE, "device_code": started["device_code"], "client_id": CLIENT_ID})
            error = answer.get("error")
            if "access_token" in answer:
                return Credential(base, answer["access_token"], answer["username"])
            if error == "slow_down":
                interval += 5  # RFC 8628, 3.5: for this and every later poll
            elif error != "authorization_pending" or waited > float(started.get("expires_in", 600)) + interval:
                raise _refusal(base, answer)


def revoke_on_portal(credential: Credential, transport: Optional[httpx.BaseTransport] = None) -> Optional[str]:
    """Ask the portal to revoke ``credential``: None once it is revoked (or was already), else why not, in words."""
    try:
        with httpx.Client(transport=transport, verify=tls(), timeout=15) as client:
            response = client.delete(f"{credential.portal_url}{API_PREFIX}/me/credential",
                                     headers={"authorization": f"Bearer {credential.access_token}"})
    except httpx.HTTPError as e:
        return f"cannot reach the portal at {credential.portal_url} ({e})"
    if response.status_code == 200 or response.status_code == 401:  # 401: already revoked, expired or unknown
        return None
    return f"the portal at {credential.portal_url} answered {response.status_code}: {response.text[:200]}"


def _post(client: httpx.Client, base: str, path: str, form: dict) -> dict:
    try:
        response = client.post(f"{base}{API_PREFIX}{path}", data=form)
    except httpx.HTTPError as e:
        raise PortalError(f"cannot reach the portal at {base} ({e}); check the address and your network") from None
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or response.status_code not in (200, 400):
        raise PortalError(f"the portal at {base} answered {response.status_code} to {path}: {response.text[:200]}")
    return answer


def _reason(answer: dict) -> str:
    return str(answer.get("error_description") or answer.get("detail") or answer.get("error") or answer)


def _refusal(base: str, answer: dict) -> PortalError:
    again = f"run `dedloc-worker login {base}` again"
    error = answer.get("error")
    if error == "access_denied":
        return PortalError(f"the login was denied in the browser; {again} if that was a mistake")
    if error in ("expired_token", "authorization_pending"):
        return PortalError(f"the login code expired before it was approved; {again}")
    if error == "invalid_grant":
        return PortalError(f"the portal says this login code was already used or is unknown; {again}")
    return PortalError(f"the portal refused the login ({error}: {_reason(answer)}); {again}")


# stored credentials ---------------------------------------------------------------------------------------------

def credentials_path() -> Path:
    """``$XDG_CONFIG_HOME/dedloc/credentials.json``, or under ``~/.config`` (XDG ignores a relative path)."""
    config_home = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(config_home) if os.path.isabs(config_home) else Path.home() / ".config"
    return base / "dedloc" / "credentials.json"


def _read_all(path: Path) -> dict:
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the stored credentials in {path} ({e}); delete that file and log in "
                          "again") from None
    if not isinstance(stored, dict) or not isinstance(stored.get("portals", {}), dict):
        raise ConfigError(f"the stored credentials in {path} are not what dedloc-worker wrote; delete that file "
                          "and log in again")
    return stored.get("portals", {})


def _write_all(path: Path, portals: dict) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # A new 0600 file renamed over the old one: never a moment where the secret is readable by others or half
    # written.
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".credentials-", suffix=".json")
    try:
        with os.fdopen(descriptor, "w") as file:
            json.dump({"portals": portals}, file, indent=2)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def load_credential(portal_url: str) -> Optional[Credential]:
    """The stored credential for this portal, or None."""
    entry = _read_all(credentials_path()).get(portal_key(portal_url))
    if not isinstance(entry, dict) or not entry.get("access_token"):
        return None
    return Credential(portal_key(portal_url), entry["access_token"], entry.get("username", ""))


def save_credential(credential: Credential) -> Path:
    """Store ``credential`` (replacing this portal's previous one); returns the file it is in."""
    path = credentials_path()
    portals = _read_all(path)
    entry = asdict(credential)
    del entry["portal_url"]
    portals[portal_key(credential.portal_url)] = {**entry, "saved_at": int(time.time())}
    _write_all(path, portals)
    return path


def forget_credential(portal_url: str) -> bool:
    """Remove this portal's stored credential (the file too when it was the last); False when there was none."""
    path = credentials_path()
    portals = _read_all(path)
    if portals.pop(portal_key(portal_url), None) is None:
        return False
    if portals:
        _write_all(path, portals)
    else:
        path.unlink()
    return True
