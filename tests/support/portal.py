"""A portal served on loopback for the sign-in tests (the fixtures that start one are in tests/conftest.py), the
worker's device login run in a thread, a whole sign-in and device login over HTTP, and the client the loopback
OpenID Connect provider knows."""

from __future__ import annotations

import re
import threading
from typing import Optional

import httpx
from dedloc_worker.portal.login import Credential, device_login
from fastapi import FastAPI
from sqlalchemy import select

from app.identity.device import DevicePolicy
from app.identity.models import User

CLIENT_ID, CLIENT_SECRET = "dedloc-portal", "provider-secret-for-tests"
SECRET_KEY = "a-test-secret-key-of-at-least-32-characters"
QUICK = DevicePolicy(lifetime=30, interval=1)  # device codes polled every second: tests stay short


class Portal:
    def __init__(self, url: str, app: FastAPI):
        self.url, self.app = url, app

    def db(self):
        return self.app.state.sessions()

    def users(self) -> list[str]:
        with self.db() as session:
            return list(session.scalars(select(User.username).order_by(User.username)))


def form_token(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def credential_by_signing_in(url: str, username: str) -> str:
    """Sign in as ``username`` (the development sign-in), start a device login, approve it and take the API
    credential: what a volunteer does with a browser and ``dedloc-worker login``, over plain HTTP."""
    grant = "urn:ietf:params:oauth:grant-type:device_code"
    with httpx.Client(base_url=url, headers={"accept": "text/html"}, timeout=15) as browser:
        signin = browser.get("/signin")
        browser.post("/signin/dev", data={"username": username, "next": "/", "csrf": form_token(signin.text)})
        started = httpx.post(f"{url}/api/v1/device/code", data={"client_name": f"{username}'s test machine"}).json()
        page = browser.get("/device", params={"user_code": started["user_code"]})
        decided = browser.post("/device", data={"user_code": started["user_code"], "decision": "approve",
                                                "csrf": form_token(page.text)})
        assert decided.status_code == 200, decided.text
    answer = httpx.post(f"{url}/api/v1/device/token", data={"grant_type": grant,
                                                            "device_code": started["device_code"]})
    assert answer.status_code == 200, answer.text
    return answer.json()["access_token"]


class LoginThread(threading.Thread):
    """``device_login`` running as the worker would, while the test plays the person in the browser."""

    def __init__(self, portal: Portal):
        super().__init__(daemon=True)
        self.portal, self.lines, self.said = portal, [], threading.Event()
        self.credential: Optional[Credential] = None
        self.error: Optional[Exception] = None

    def say(self, line: str) -> None:
        self.lines.append(line)
        self.said.set()

    def run(self) -> None:
        try:
            self.credential = device_login(self.portal.url, say=self.say)
        except Exception as e:  # handed to the test, which reads it
            self.error = e

    def user_code(self) -> str:
        assert self.said.wait(10), "device_login printed nothing"
        return re.search(r"enter the code ([A-Z]{4}-[A-Z]{4})", self.lines[0]).group(1)

    def finish(self) -> "LoginThread":
        self.join(20)
        assert not self.is_alive(), "device_login did not return"
        return self
