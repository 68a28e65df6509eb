"""A real browser (Playwright driving Debian's Chromium) on the dashboard of a running `dedloc demo`."""

from __future__ import annotations

import re
import signal
from datetime import datetime, timezone

import pytest

from tests.support.browsers import needs_chromium
from tests.support.harness import hivemind_sockets, tagged_processes, unbound_hivemind_sockets, wait_for

pytestmark = [pytest.mark.swarm, needs_chromium]


def counter(page) -> int:
    return int(page.locator("#samples_total").inner_text().replace(",", ""))


def test_the_dashboard_of_a_running_demo_moves_without_a_reload(deployment, chromium_browser, output_dir):
    sockets_before = hivemind_sockets()  # only files the demo's processes create count below
    demo = deployment.start("demo", "-m", "app.cli", "demo")
    url = f"{deployment.url}/runs/demo"
    wait_for(lambda: deployment.get("/api/v1/runs/demo/swarm")["samples_total"] > 0, 150, "the demo to credit samples")

    page = chromium_browser.new_page(viewport={"width": 1280, "height": 900})
    navigations = []
    page.on("framenavigated", lambda frame: navigations.append(frame.url))
    page.goto(url)
    first = counter(page)
    page.wait_for_function(
        f"Number(document.querySelector('#samples_total').textContent.replaceAll(',', '')) > {first}", timeout=60_000
    )
    assert counter(page) > first
    assert navigations == [url], "the page reloaded"
    assert page.locator("#live-state").inner_text() == "· live"
    # The averaging plan of the two workers: on the page, or drawn in when the epoch moves after the coordinator
    # published it.
    page.wait_for_function("document.querySelectorAll('#plan-peers tbody tr').length === 2", timeout=60_000)
    plan = page.locator("#plan-peers").inner_text()
    assert "alice" in plan and "bob" in plan and "aggregator" in plan, plan
    # a few ms on loopback's Gbit/s links: drawn as milliseconds, not "0.00 s"
    assert re.fullmatch(r"\d+(\.\d)? ms|[1-9]\d*\.\d\d s", page.locator("#plan-predicted").inner_text())
    page.wait_for_timeout(1500)  # let the charts draw a few points
    page.screenshot(path=str(output_dir / "dashboard.png"), full_page=True)
    assert "alice" in page.locator("#leaders").inner_text()

    # Ctrl-C ends the demo and everything it started; a second run in the same folder comes up again.
    demo.send_signal(signal.SIGINT)
    assert demo.wait(60) == 0
    wait_for(lambda: not tagged_processes(deployment.tag), 15, "every demo process to end")
    # ... and removed the socket files of hivemind's processes (each averager's used to stay in /tmp)
    demo_sockets = unbound_hivemind_sockets() - sockets_before
    assert not demo_sockets, demo_sockets
    again = deployment.start("demo-again", "-m", "app.cli", "demo")
    restarted = datetime.now(timezone.utc)
    wait_for(lambda: (lambda swarm: swarm["peers_online"] >= 1 and swarm["updated_at"]
                      and datetime.fromisoformat(swarm["updated_at"]) > restarted)(
        deployment.get("/api/v1/runs/demo/swarm")), 150, "the second demo's founder training")
    again.send_signal(signal.SIGINT)
    assert again.wait(60) == 0
    # Everything the demo's processes printed while they trained: expected events are one line each. (At exit,
    # hivemind's child processes can still print one when their parent's pipe closes first: not checked here.)
    for name in ("demo", "demo-again"):
        printed = (deployment.logs / f"{name}.log").read_text()
        running = printed.split("stopping the demo...")[0]
        assert "left the swarm" in printed and "Traceback" not in running, running[-4000:]
