"""A real browser (Playwright driving Debian's Chromium) signs in, with the development sign-in and with the
loopback OpenID Connect provider, and approves a device code while the worker's ``device_login`` polls."""

from __future__ import annotations

import re

from tests.support.browsers import needs_chromium
from tests.support.portal import CLIENT_ID, CLIENT_SECRET, LoginThread

# The provider on loopback and the portals served by uvicorn are fixtures of tests/conftest.py.
pytestmark = needs_chromium


def test_dev_sign_in_and_approve_a_worker_in_the_browser(start_portal, page, output_dir):
    portal = start_portal()
    page.goto(f"{portal.url}/signin")
    assert "for local use only" in page.locator(".dev-signin").inner_text()
    page.fill("#username", "alice")
    page.click("#signin-dev")
    page.wait_for_url(f"{portal.url}/")
    assert page.locator("#signed-in-as").inner_text() == "alice"

    login = LoginThread(portal)  # the worker, polling every second
    login.start()
    code = login.user_code()
    approval_url = re.search(r"\(or open (\S+)\)", login.lines[1]).group(1)
    page.goto(approval_url)
    assert page.locator("#user-code").inner_text() == code
    page.screenshot(path=str(output_dir / "device-approval.png"), full_page=True)
    page.click("#approve")
    assert "Approved" in page.locator("#device-result").inner_text()
    credential = login.finish().credential
    assert login.error is None and credential.username == "alice"

    page.click("#signout")
    page.wait_for_url(f"{portal.url}/")
    assert page.locator("#signin-link").is_visible()


def test_sign_in_with_the_provider_in_the_browser(start_portal, provider, page, output_dir):
    portal = start_portal(oidc_issuer=provider.issuer, oidc_client_id=CLIENT_ID, oidc_client_secret=CLIENT_SECRET)
    page.goto(f"{portal.url}/device")  # a page for signed-in users sends the visitor to sign in, then back
    page.wait_for_url(re.compile(r".*/signin\?next=%2Fdevice$"))
    page.click("#signin-provider")
    page.wait_for_url(f"{portal.url}/device")
    assert page.locator("#signed-in-as").inner_text() == "alice"
    page.fill("#user_code", "bcdf-ghjk")
    page.click("#continue")
    assert "no device login has the code" in page.locator("#device-error").inner_text()
    page.screenshot(path=str(output_dir / "signed-in-with-provider.png"), full_page=True)
