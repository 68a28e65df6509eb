"""The volunteer's and the organizer's paths end to end, in a real browser (Playwright + Debian's Chromium):
sign in, copy the two lines from the join page, approve the worker's code, see it train under your name."""

from __future__ import annotations

import io
import re
import shlex
import time
import zipfile

import httpx
import pytest

from tests.support.browsers import needs_chromium
from tests.support.harness import wait_for

pytestmark = [pytest.mark.swarm, needs_chromium]


def sign_in(page, url: str, username: str) -> None:
    page.goto(f"{url}/signin")
    page.fill("#username", username)
    page.click("#signin-dev")
    assert page.locator("#signed-in-as").inner_text() == username


def test_sign_in_copy_two_lines_approve_train_and_get_banned(deployment, chromium_browser, output_dir, tmp_path):
    deployment.env["DEDLOC_ORGANIZERS"] = '["olivia"]'
    deployment.start_swarm(["alice"])  # a run already under way: its founder trains

    page = chromium_browser.new_page()
    sign_in(page, deployment.url, "vera")
    page.goto(f"{deployment.url}/runs/{deployment.slug}/join")
    install, join = page.locator("#install-line").inner_text(), page.locator("#join-line").inner_text()
    page.screenshot(path=str(output_dir / "join-page.png"), full_page=True)

    # Line 1 installs the wheel this portal serves, built from worker/.
    wheel = httpx.get(install.split()[-1], timeout=120)
    assert install.startswith("pip install ") and wheel.status_code == 200
    assert "dedloc_worker/cli.py" in zipfile.ZipFile(io.BytesIO(wheel.content)).namelist()
    notebook = httpx.get(deployment.url + page.locator("#notebook").get_attribute("href")).json()
    assert any(join in "".join(cell["source"]) for cell in notebook["cells"])

    # Line 2, as typed in a terminal (the installed console script is the module): it asks for a device login.
    args = shlex.split(join)
    assert args[:2] == ["dedloc-worker", "join"]
    deployment.env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    worker = deployment.start("vera", "-m", "dedloc_worker", *args[1:], "--listen", "/ip4/127.0.0.1/tcp/0")
    log = deployment.logs / "vera.log"
    link = wait_for(lambda: re.search(r"\(or open (\S+)\)", log.read_text()), 60, "the worker's login link").group(1)
    page.goto(link)
    page.click("#approve")
    assert "Approved" in page.locator("#device-result").inner_text()

    wait_for(lambda: "joining run 'test' as vera" in log.read_text(), 60, "vera's worker to join")
    credentials = tmp_path / "config" / "dedloc" / "credentials.json"
    assert credentials.stat().st_mode & 0o777 == 0o600  # the next join needs no login
    wait_for(lambda: any(row["username"] == "vera" and row["samples"] > 0
                         for row in deployment.get(f"/api/v1/runs/{deployment.slug}/leaderboard")),
             90, "vera credited on the leaderboard")
    page.goto(f"{deployment.url}/runs/{deployment.slug}/leaderboard")
    assert "vera" in page.locator("#leaders").inner_text()

    # Vera is no organizer; Olivia is, and bans her from the web UI while her worker runs.
    page.goto(f"{deployment.url}/runs/{deployment.slug}/organize")
    assert "not an organizer" in page.content()
    organizer = chromium_browser.new_page()
    sign_in(organizer, deployment.url, "olivia")
    organizer.goto(f"{deployment.url}/runs/{deployment.slug}/organize")
    assert "vera" in organizer.locator("#holders").inner_text()
    organizer.fill("#ban-form input[name=username]", "vera")
    organizer.fill("#ban-form input[name=reason]", "testing bans")
    banned_at = time.monotonic()
    organizer.click("#ban-form button")
    assert "testing bans" in organizer.locator("#bans").inner_text()
    organizer.screenshot(path=str(output_dir / "organize.png"), full_page=True)
    assert worker.wait(60) == 6, log.read_text()[-2000:]
    print(f"vera's worker was cut off {time.monotonic() - banned_at:.1f} s after the ban")
    assert "vera was banned from this run by its organizers" in log.read_text()
    assert deployment.processes["alice"].poll() is None  # the founder trains on
