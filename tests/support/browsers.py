"""Debian's Chromium, driven by Playwright, for the tests that use a real browser."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]

needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(),
                                    reason="Debian's chromium is not installed (apt-get install chromium)")


@contextlib.contextmanager
def launch_chromium():
    """A Playwright browser on Debian's Chromium, closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()
