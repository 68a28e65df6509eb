"""Sign-in and device login through the real portal served on loopback: a real OpenID Connect exchange with a
provider served by the tests (tests/support/oidc_provider.py), the development sign-in, the device authorization
grant with the worker's own client, API credentials, and the worker's credentials file."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from datetime import timedelta
from typing import Optional
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx
import pytest
from dedloc_worker.errors import PortalError
from dedloc_worker.portal.login import Credential, device_login, forget_credential, load_credential, save_credential
from fastapi.testclient import TestClient
from sqlalchemy import func, inspect, select

from app.core.clock import utcnow
from app.core.config import Settings
from app.core.database import downgrade, make_engine, migrate
from app.identity import oidc
from app.identity.device import DevicePolicy
from app.identity.models import ApiCredential, DeviceCode, User
from app.web.main import create_app
from tests.support.portal import CLIENT_ID, CLIENT_SECRET, SECRET_KEY, LoginThread, Portal, form_token

BROWSER = {"accept": "text/html,application/xhtml+xml"}


# fixtures --------------------------------------------------------------------------------------------------------

@pytest.fixture
def portal(start_portal) -> Portal:
    """A portal without a sign-in provider, bound to loopback: the development sign-in is offered."""
    return start_portal()


@pytest.fixture
def oidc_portal(start_portal, provider) -> Portal:
    return start_portal(oidc_issuer=provider.issuer, oidc_client_id=CLIENT_ID, oidc_client_secret=CLIENT_SECRET)


@pytest.fixture
def browser():
    with httpx.Client(headers=BROWSER, timeout=15) as client:
        yield client


# helpers ---------------------------------------------------------------------------------------------------------

def dev_sign_in(client: httpx.Client, portal: Portal, username: str, next: str = "/") -> httpx.Response:
    page = client.get(f"{portal.url}/signin", params={"next": next})
    return client.post(f"{portal.url}/signin/dev", follow_redirects=True,
                       data={"username": username, "next": next, "csrf": form_token(page.text)})


def signed_in_as(client: httpx.Client, portal: Portal) -> Optional[str]:
    found = re.search(r'id="signed-in-as">([^<]+)<', client.get(f"{portal.url}/").text)
    return found and found.group(1)


def decide(client: httpx.Client, portal: Portal, user_code: str, decision: str) -> httpx.Response:
    page = client.get(f"{portal.url}/device", params={"user_code": user_code})
    assert page.status_code == 200, page.text
    return client.post(f"{portal.url}/device", data={"user_code": user_code, "decision": decision,
                                                      "csrf": form_token(page.text)})


def start_device(portal: Portal) -> dict:
    response = httpx.post(f"{portal.url}/api/v1/device/code", data={"client_name": "test worker on host"})
    assert response.status_code == 200, response.text
    return response.json()


def poll(portal: Portal, device_code: str) -> httpx.Response:
    return httpx.post(f"{portal.url}/api/v1/device/token", data={
        "grant_type": "urn:ietf:params:oauth:grant-type:device_code", "device_code": device_code})


def oidc_redirects(client: httpx.Client, portal: Portal) -> str:
    """Start a sign-in and follow it to the provider and back, up to the callback URL (not yet opened)."""
    to_provider = client.get(f"{portal.url}/signin/oidc", params={"next": "/runs"})
    assert to_provider.status_code == 302, to_provider.text
    back = client.get(to_provider.headers["location"])
    assert back.status_code == 302, back.text
    return back.headers["location"]


# OpenID Connect --------------------------------------------------------------------------------------------------

def test_oidc_sign_in_creates_the_user_and_a_session(oidc_portal, provider, browser):
    landed = browser.get(f"{oidc_portal.url}/signin/oidc", params={"next": "/"}, follow_redirects=True)
    assert landed.status_code == 200 and str(landed.url) == f"{oidc_portal.url}/"
    assert [urlsplit(str(r.url)).path for r in landed.history] == ["/signin/oidc", "/authorize",
                                                                   "/signin/oidc/callback"]
    cookie = landed.history[-1].headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=lax" in cookie and "secure" not in cookie
    assert signed_in_as(browser, oidc_portal) == "alice"
    with oidc_portal.db() as session:
        user = session.scalar(select(User))
        assert (user.username, user.oidc_issuer, user.oidc_subject) == ("alice", provider.issuer, "subject-alice")

    # Signing in again finds the same user; signing out ends the session.
    browser.get(f"{oidc_portal.url}/signin/oidc", follow_redirects=True)
    assert oidc_portal.users() == ["alice"]
    home = browser.get(f"{oidc_portal.url}/")
    browser.post(f"{oidc_portal.url}/signout", data={"csrf": form_token(home.text)}, follow_redirects=True)
    assert signed_in_as(browser, oidc_portal) is None


@pytest.mark.parametrize("scope, organizations", [("openid profile read-org", ["bigscience", "neuropark"]),
                                                  ("openid profile", [])])
def test_organizations_come_from_userinfo_with_the_read_org_scope(start_portal, provider, browser, scope,
                                                                  organizations):
    """As on Hugging Face: the ID token has no `orgs`; userinfo lists them to an app granted read-org."""
    provider.organizations = ("bigscience", "neuropark")
    portal = start_portal(oidc_issuer=provider.issuer, oidc_client_id=CLIENT_ID, oidc_client_secret=CLIENT_SECRET,
                          oidc_scopes=scope)
    landed = browser.get(f"{portal.url}/signin/oidc", follow_redirects=True)
    assert landed.status_code == 200 and signed_in_as(browser, portal) == "alice"
    with portal.db() as session:
        assert session.scalar(select(User.organizations)) == organizations
    team_choices = re.findall(r'<option value="([^"]+)"', browser.get(f"{portal.url}/me").text)
    assert team_choices == organizations


def test_hugging_face_is_asked_for_organizations_by_default():
    assert oidc.scopes(Settings(oidc_issuer="https://huggingface.co")) == "openid profile read-org"
    assert oidc.scopes(Settings(oidc_issuer="https://id.example.org")) == "openid profile"
    assert oidc.scopes(Settings(oidc_scopes=" openid profile email ")) == "openid profile email"


@pytest.mark.parametrize("mode, status, reason", [
    ("wrong_nonce", 401, "nonce is not the one this sign-in sent"),
    ("expired", 401, "it has expired"),
    ("wrong_audience", 401, "issued for another application"),
    ("unknown_key", 401, "signature does not verify"),
    ("access_denied", 403, "did not let you sign in (access_denied: The user declined)"),
])
def test_oidc_refusals_are_clear_pages(oidc_portal, provider, browser, mode, status, reason):
    provider.reset(mode)
    page = browser.get(f"{oidc_portal.url}/signin/oidc", follow_redirects=True)
    assert page.status_code == status
    assert "<html" in page.text and "Sign-in refused" in page.text and reason in page.text
    assert signed_in_as(browser, oidc_portal) is None and oidc_portal.users() == []


def test_oidc_refuses_a_wrong_state_a_replay_and_another_browser(oidc_portal, browser):
    callback = oidc_redirects(browser, oidc_portal)
    query = parse_qs(urlsplit(callback).query)
    forged = callback.split("?")[0] + "?" + urlencode({"code": query["code"][0], "state": "forged-state"})
    refused = browser.get(forged)
    assert refused.status_code == 400 and "the state does not match" in refused.text

    callback = oidc_redirects(browser, oidc_portal)
    with httpx.Client(headers=BROWSER) as elsewhere:  # the same link opened in another browser
        assert elsewhere.get(callback).status_code == 400
    assert browser.get(callback).status_code == 303  # the browser that started it signs in
    assert browser.get(callback).status_code == 400  # but only once
    assert oidc_portal.users() == ["alice"]


def test_an_unreachable_provider_is_a_clear_page(start_portal, browser):
    portal = start_portal(oidc_issuer="http://127.0.0.1:1", oidc_client_id=CLIENT_ID)
    page = browser.get(f"{portal.url}/signin/oidc")
    assert page.status_code == 502 and "<html" in page.text and "try again later" in page.text


def test_the_provider_is_the_only_sign_in_when_configured(oidc_portal, browser):
    page = browser.get(f"{oidc_portal.url}/signin")
    assert page.status_code == 200 and 'id="signin-provider"' in page.text and "signin-dev" not in page.text
    refused = browser.post(f"{oidc_portal.url}/signin/dev", data={"username": "mallory", "csrf": "x"})
    assert refused.status_code == 403 and "signs in through 127.0.0.1" in refused.text
    assert oidc_portal.users() == []


# development sign-in -----------------------------------------------------------------------------------------------

def test_dev_sign_in_on_loopback(portal, browser):
    page = browser.get(f"{portal.url}/signin")
    assert page.status_code == 200 and "for local use only" in page.text.lower()
    landed = dev_sign_in(browser, portal, "bob", next="/runs/none")
    assert urlsplit(str(landed.url)).path == "/runs/none"  # back where sign-in was asked for
    assert signed_in_as(browser, portal) == "bob" and portal.users() == ["bob"]
    elsewhere = dev_sign_in(browser, portal, "bob", next="//evil.example/")
    assert str(elsewhere.url) == f"{portal.url}/"  # never sent off the portal
    # A form without this session's token is refused: another site cannot sign a visitor in or out.
    assert browser.post(f"{portal.url}/signout", data={"csrf": "forged"}).status_code == 403
    assert signed_in_as(browser, portal) == "bob"


def test_dev_sign_in_refused_on_a_public_bind_address(start_portal, browser):
    public = start_portal(host="0.0.0.0")
    page = browser.get(f"{public.url}/signin")
    assert page.status_code == 403 and "local use only" in page.text and "0.0.0.0" in page.text
    assert "signin-dev" not in page.text
    refused = browser.post(f"{public.url}/signin/dev", data={"username": "mallory", "csrf": "x"})
    assert refused.status_code == 403 and "not on a loopback address" in refused.text
    assert public.users() == []


def test_dev_sign_in_refused_through_a_proxy(portal, browser):
    page = browser.get(f"{portal.url}/signin")
    refused = browser.post(f"{portal.url}/signin/dev", headers={"x-forwarded-for": "203.0.113.9"},
                           data={"username": "mallory", "csrf": form_token(page.text)})
    assert refused.status_code == 403 and "came through a proxy" in refused.text
    assert portal.users() == []


def test_the_session_cookie_is_secure_over_https(tmp_path, migrated_database):
    shutil.copy(migrated_database, tmp_path / "db.sqlite3")
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite3'}", data_dir=tmp_path,
                              secret_key=SECRET_KEY))
    for base, secure in (("https://portal.example", True), ("http://127.0.0.1", False)):
        with TestClient(app, base_url=base) as client:
            cookie = client.get("/signin").headers["set-cookie"].lower()
            assert ("; secure" in cookie) is secure and "httponly" in cookie and "samesite=lax" in cookie


# device login ----------------------------------------------------------------------------------------------------

def test_device_login_approved_in_the_browser(portal, browser):
    dev_sign_in(browser, portal, "carol")
    login = LoginThread(portal)
    login.start()
    page = browser.get(f"{portal.url}/device", params={"user_code": login.user_code().lower()})  # any case
    assert "test worker" not in page.text and "dedloc-worker 0.1.0 on" in page.text  # what is asking
    assert decide(browser, portal, login.user_code(), "approve").status_code == 200
    credential = login.finish().credential
    assert login.error is None and credential.username == "carol" and credential.portal_url == portal.url
    with portal.db() as session:
        stored = session.scalar(select(ApiCredential))
        assert stored.token_hash == hashlib.sha256(credential.access_token.encode()).hexdigest()
    me = httpx.get(f"{portal.url}/api/v1/me", headers={"authorization": f"Bearer {credential.access_token}"})
    assert me.json() == {"username": "carol", "organizer": False}


def test_device_code_approved_then_used_once(portal, browser):
    dev_sign_in(browser, portal, "dave")
    started = start_device(portal)
    assert re.fullmatch(r"[BCDFGHJKLMNPQRSTVWXZ]{4}-[BCDFGHJKLMNPQRSTVWXZ]{4}", started["user_code"])
    assert started["verification_uri"] == f"{portal.url}/device"
    assert started["verification_uri_complete"] == f"{portal.url}/device?user_code={started['user_code']}"
    assert (started["expires_in"], started["interval"]) == (30, 1)
    assert poll(portal, started["device_code"]).json()["error"] == "authorization_pending"
    done = decide(browser, portal, started["user_code"], "approve")
    assert "Approved" in done.text
    granted = poll(portal, started["device_code"])
    assert granted.status_code == 200 and granted.headers["cache-control"] == "no-store"
    assert granted.json()["token_type"] == "bearer" and granted.json()["username"] == "dave"
    again = poll(portal, started["device_code"])
    assert again.status_code == 400 and again.json()["error"] == "invalid_grant"
    assert poll(portal, "never-issued").json()["error"] == "invalid_grant"
    # A decided code cannot be decided again.
    page = browser.get(f"{portal.url}/device", params={"user_code": started["user_code"]})
    assert page.status_code == 400 and "already used" in page.text


def test_device_login_denied(portal, browser):
    dev_sign_in(browser, portal, "erin")
    login = LoginThread(portal)
    login.start()
    assert "Denied" in decide(browser, portal, login.user_code(), "deny").text
    login.finish()
    assert login.credential is None and isinstance(login.error, PortalError)
    assert str(login.error).startswith("the login was denied in the browser")
    with portal.db() as session:
        assert session.scalar(select(ApiCredential)) is None


def test_device_code_expires(start_portal, browser):
    portal = start_portal(DevicePolicy(lifetime=1, interval=1))
    dev_sign_in(browser, portal, "frank")
    login = LoginThread(portal)
    login.start()
    code = login.user_code()
    login.finish()
    assert "the login code expired before it was approved" in str(login.error)
    page = browser.get(f"{portal.url}/device", params={"user_code": code})
    assert page.status_code == 400 and "has expired" in page.text

    started = start_device(portal)  # expiry as recorded in the database, whatever the lifetime was
    with portal.db() as session:
        row = session.scalar(select(DeviceCode).where(DeviceCode.user_code == started["user_code"]))
        row.expires_at = utcnow() - timedelta(seconds=1)
        session.commit()
    assert poll(portal, started["device_code"]).json()["error"] == "expired_token"


def test_polling_too_fast_is_slowed_down(portal):
    started = start_device(portal)
    assert poll(portal, started["device_code"]).json()["error"] == "authorization_pending"
    fast = poll(portal, started["device_code"]).json()
    assert fast["error"] == "slow_down" and "wait 6 s" in fast["error_description"]
    with portal.db() as session:
        assert session.scalar(select(DeviceCode.interval)) == 6


def test_the_device_page_needs_a_signed_in_user_and_a_form_token(portal, browser):
    started = start_device(portal)
    asked = browser.get(f"{portal.url}/device", params={"user_code": started["user_code"]})
    assert asked.status_code == 303
    assert asked.headers["location"] == f"/signin?next=%2Fdevice%3Fuser_code%3D{started['user_code']}"
    landed = dev_sign_in(browser, portal, "grace", next=f"/device?user_code={started['user_code']}")
    assert landed.status_code == 200 and started["user_code"] in landed.text and 'id="approve"' in landed.text
    forged = browser.post(f"{portal.url}/device", data={"user_code": started["user_code"], "decision": "approve"})
    assert forged.status_code == 403
    assert poll(portal, started["device_code"]).json()["error"] == "authorization_pending"
    unknown = browser.get(f"{portal.url}/device", params={"user_code": "BBBB-BBBB"})
    assert unknown.status_code == 404 and "no device login has the code" in unknown.text


# API credentials -------------------------------------------------------------------------------------------------

def test_api_user_accepts_a_credential_and_refuses_a_revoked_one(portal, browser):
    dev_sign_in(browser, portal, "heidi")
    started = start_device(portal)
    decide(browser, portal, started["user_code"], "approve")
    token = poll(portal, started["device_code"]).json()["access_token"]
    bearer = {"authorization": f"Bearer {token}"}
    assert httpx.get(f"{portal.url}/api/v1/me", headers=bearer).json()["username"] == "heidi"
    with portal.db() as session:
        assert session.scalar(select(ApiCredential.last_used_at)) is not None

    missing = httpx.get(f"{portal.url}/api/v1/me")
    assert missing.status_code == 401 and "missing API credential" in missing.json()["detail"]
    unknown = httpx.get(f"{portal.url}/api/v1/me", headers={"authorization": "Bearer dedloc_nope"})
    assert unknown.status_code == 401 and "unknown API credential" in unknown.json()["detail"]
    assert httpx.delete(f"{portal.url}/api/v1/me/credential", headers=bearer).json()["revoked"] is True
    revoked = httpx.get(f"{portal.url}/api/v1/me", headers=bearer)
    assert revoked.status_code == 401 and "revoked" in revoked.json()["detail"]


def approved_credential(portal: Portal, browser: httpx.Client, username: str) -> str:
    dev_sign_in(browser, portal, username)
    started = start_device(portal)
    decide(browser, portal, started["user_code"], "approve")
    return poll(portal, started["device_code"]).json()["access_token"]


def me_status(portal: Portal, token: str) -> int:
    return httpx.get(f"{portal.url}/api/v1/me", headers={"authorization": f"Bearer {token}"}).status_code


def test_a_machine_credential_is_revoked_from_the_page(portal, browser):
    token = approved_credential(portal, browser, "heidi")
    assert me_status(portal, token) == 200
    with httpx.Client(headers=BROWSER, timeout=15) as other:  # another user's machine, untouched by heidi
        other_token = approved_credential(portal, other, "ivan")
    page = browser.get(f"{portal.url}/me")
    row = re.search(r'<table class="leaders" id="credentials">(.*?)</table>', page.text, re.S).group(1)
    assert "test worker on host" in row and "valid" in row
    with portal.db() as session:
        mine, theirs = (session.scalar(select(ApiCredential.id).join(User).where(User.username == name))
                        for name in ("heidi", "ivan"))

    foreign = browser.post(f"{portal.url}/me/credentials/{theirs}/revoke", data={"csrf": form_token(page.text)})
    assert foreign.status_code == 404 and me_status(portal, other_token) == 200
    forged = browser.post(f"{portal.url}/me/credentials/{mine}/revoke", data={"csrf": "forged"})
    assert forged.status_code == 403 and me_status(portal, token) == 200
    revoked = browser.post(f"{portal.url}/me/credentials/{mine}/revoke", data={"csrf": form_token(page.text)})
    assert revoked.status_code == 303 and revoked.headers["location"] == "/me#machines"
    refused = httpx.get(f"{portal.url}/api/v1/me", headers={"authorization": f"Bearer {token}"})
    assert refused.status_code == 401 and "revoked" in refused.json()["detail"]
    assert "revoked 20" in browser.get(f"{portal.url}/me").text and me_status(portal, other_token) == 200


def test_credentials_expire_after_the_deployment_lifetime(start_portal, browser):
    portal = start_portal(api_credential_lifetime=86400)
    token = approved_credential(portal, browser, "judy")
    assert me_status(portal, token) == 200
    with portal.db() as session:  # a day and a minute later
        credential = session.scalar(select(ApiCredential))
        credential.created_at = utcnow() - timedelta(days=1, minutes=1)
        session.commit()
    expired = httpx.get(f"{portal.url}/api/v1/me", headers={"authorization": f"Bearer {token}"})
    assert expired.status_code == 401 and "expired" in expired.json()["detail"]
    assert "dedloc-worker login" in expired.json()["detail"]


def test_device_logins_are_rate_limited_per_address(start_portal):
    portal = start_portal(policy=DevicePolicy(lifetime=30, interval=1, per_address_per_minute=3))
    for _ in range(3):
        start_device(portal)
    refused = httpx.post(f"{portal.url}/api/v1/device/code", data={"client_name": "a flood"})
    assert refused.status_code == 429 and "device logins a minute" in refused.json()["detail"]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    # Another address (uvicorn trusts X-Forwarded-For from loopback, as from a proxy there) is not held back.
    elsewhere = httpx.post(f"{portal.url}/api/v1/device/code", headers={"x-forwarded-for": "203.0.113.7"})
    assert elsewhere.status_code == 200 and elsewhere.json()["user_code"]
    with portal.db() as session:
        assert session.scalar(select(func.count(DeviceCode.id))) == 4


# the worker's side -----------------------------------------------------------------------------------------------

def test_device_login_waits_the_interval_and_slows_down_when_told():
    """A portal that refuses any poll earlier than its interval, and asks once to slow down (virtual time)."""
    clock = {"now": 0.0}
    portal = {"interval": 2, "last": None, "slowed": False}

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/device/code":
            return httpx.Response(200, json={
                "device_code": "dc", "user_code": "BCDF-GHJK", "verification_uri": "http://p/device",
                "verification_uri_complete": "http://p/device?user_code=BCDF-GHJK", "expires_in": 600,
                "interval": 2})
        now, last = clock["now"], portal["last"]
        portal["last"] = now
        if last is not None and now - last < portal["interval"]:
            return httpx.Response(400, json={"error": "invalid_request", "error_description": "too early"})
        if not portal["slowed"]:
            portal["slowed"], portal["interval"] = True, portal["interval"] + 5
            return httpx.Response(400, json={"error": "slow_down"})
        if now < 20:
            return httpx.Response(400, json={"error": "authorization_pending"})
        return httpx.Response(200, json={"access_token": "secret", "token_type": "bearer", "username": "ivan"})

    lines = []
    credential = device_login("http://p/", say=lines.append, transport=httpx.MockTransport(answer),
                              sleep=lambda seconds: clock.update(now=clock["now"] + seconds))
    assert credential == Credential("http://p", "secret", "ivan")
    assert clock["now"] == 2 + 7 + 7 + 7  # first poll after 2 s, then every 7 s
    assert "http://p/device" in lines[0] and "BCDF-GHJK" in lines[0]


def test_device_login_says_when_the_portal_is_unreachable():
    with pytest.raises(PortalError, match="cannot reach the portal at http://127.0.0.1:1 "):
        device_login("http://127.0.0.1:1/", say=lambda line: None)


def test_the_credentials_file_is_private_and_logout_removes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert load_credential("http://a.example") is None and forget_credential("http://a.example") is False
    path = save_credential(Credential("http://a.example/", "secret-a", "alice"))
    save_credential(Credential("http://b.example", "secret-b", "bob"))
    assert path == tmp_path / "config" / "dedloc" / "credentials.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_credential("http://a.example") == Credential("http://a.example", "secret-a", "alice")
    save_credential(Credential("http://a.example", "secret-a2", "alice"))  # a new login replaces the old one
    assert load_credential("http://a.example/").access_token == "secret-a2"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert forget_credential("http://a.example") is True and load_credential("http://a.example") is None
    assert load_credential("http://b.example").username == "bob"
    assert forget_credential("http://b.example") is True and not path.exists()


def logout(portal_url: str, config_home) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dedloc_worker", "logout", portal_url], capture_output=True, text=True,
                          timeout=60,
                          env={**os.environ, "XDG_CONFIG_HOME": str(config_home)})


def test_worker_logout_revokes_the_credential_on_the_portal(portal, browser, tmp_path):
    token = approved_credential(portal, browser, "kim")
    config = tmp_path / "config"
    env_path = config / "dedloc" / "credentials.json"
    env_path.parent.mkdir(parents=True)
    env_path.write_text(json.dumps({"portals": {portal.url: {"access_token": token, "username": "kim"}}}))
    assert me_status(portal, token) == 200

    done = logout(portal.url, config)
    assert done.returncode == 0 and "the portal revoked this machine's credential" in done.stdout, done
    assert me_status(portal, token) == 401 and not env_path.exists()
    assert "revoked 20" in browser.get(f"{portal.url}/me").text


def test_worker_logout_without_the_portal_forgets_and_says_where_to_revoke(tmp_path):
    config = tmp_path / "config"
    path = config / "dedloc" / "credentials.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"portals": {"http://127.0.0.1:1": {"access_token": "secret", "username": "kim"}}}))
    done = logout("http://127.0.0.1:1", config)
    assert done.returncode == 1 and "Traceback" not in done.stderr and not path.exists()
    assert "could not revoke it there" in done.stdout and "http://127.0.0.1:1/me#machines" in done.stdout


# schema ----------------------------------------------------------------------------------------------------------

def test_the_identity_migration_goes_up_and_down(database_url):
    def tables() -> set[str]:
        engine = make_engine(database_url)
        try:
            return set(inspect(engine).get_table_names())
        finally:
            engine.dispose()

    identity = {"users", "api_credentials", "device_codes"}
    migrate(database_url, "0002")
    assert identity <= tables()
    downgrade(database_url, "0001")
    assert not identity & tables() and "runs" in tables()
    migrate(database_url)
    assert identity <= tables()
