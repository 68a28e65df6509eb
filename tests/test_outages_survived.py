"""A run's outages, survived, on one deployment (portal, coordinator and two workers as processes on loopback),
checked in order: a worker waits for a coordinator with backoff; tokens are renewed at half-life; the coordinator
down: the status page says so (in a real browser, without a reload), and a ban placed meanwhile still cuts the
banned peer off; the portal down past half-life: the worker trains on and warns; then past the token's expiry: it
holds its training and stays; the portal back: it renews and trains again."""

from __future__ import annotations

import re
import shutil
import time
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select

from app.core.database import make_engine, make_sessionmaker
from app.models import IssuedPeerToken, Snapshot
from tests.support.browsers import launch_chromium, needs_chromium
from tests.support.harness import Deployment, local_epoch, wait_for

pytestmark = pytest.mark.swarm
LIFETIME = 30  # seconds a peer token lives: renewed at half-life, 15 s
# docs/architecture.md#outages: a ban reaches running peers from the portal within about 10 s while no coordinator
# is up; more here, for two busy cores.
BAN_BOUND = 30


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, output_dir):
    logs = output_dir / "logs" / "test_outages_survived"
    shutil.rmtree(logs, ignore_errors=True)
    deployed = Deployment(tmp_path_factory.mktemp("outages"), logs)
    deployed.env.update({"DEDLOC_PEER_TOKEN_LIFETIME": str(LIFETIME), "DEDLOC_COORDINATOR_TIMEOUT": "5"})
    yield deployed
    deployed.close()


def query(deployment, statement):
    engine = make_engine(deployment.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            return session.execute(statement).scalar()
    finally:
        engine.dispose()


def tokens_issued(deployment, username: str) -> int:
    return query(deployment, select(func.count()).select_from(IssuedPeerToken).where(
        IssuedPeerToken.username == username))


def swarm_epoch(deployment) -> int:
    """The newest epoch the coordinator saw, from the database (the portal may be down)."""
    return query(deployment, select(func.max(Snapshot.epoch))) or 0


def log(deployment, name: str) -> str:
    return (deployment.logs / f"{name}.log").read_text()


def status(deployment) -> dict:
    return deployment.get(f"/api/v1/runs/{deployment.slug}/status")


def test_a_worker_waits_for_a_coordinator_with_backoff_and_joins_when_one_is_up(deployment):
    deployment.create_run(target_batch_size=2048)
    deployment.start_portal()
    assert status(deployment)["coordinators_up"] == 0
    deployment.start_worker("alice")
    wait_for(lambda: "asking again in 2 s" in log(deployment, "alice"), 120, "alice to ask twice")
    waiting = log(deployment, "alice")
    assert "no coordinator of run 'test' has started yet; workers wait until one is up; asking again in 1 s" in waiting

    deployment.start_coordinator()
    wait_for(lambda: "joining run 'test'" in log(deployment, "alice"), 120, "alice to join")
    deployment.wait_for_founder("alice", timeout=120)
    deployment.start_worker("bob")
    up = wait_for(lambda: (lambda s: s if s["peers"]["online"] == 2 else None)(status(deployment)), 120,
                  "both workers online")
    assert up["coordinators_up"] == 1 and up["notice"] is None and up["peers"]["reachable"] == 2


def test_tokens_are_renewed_at_half_life(deployment):
    before = tokens_issued(deployment, "alice")
    wait_for(lambda: tokens_issued(deployment, "alice") > before, 2 * LIFETIME, "alice's token renewed")
    engine = make_engine(deployment.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            renewed, previous = session.execute(select(IssuedPeerToken.issued_at).where(
                IssuedPeerToken.username == "alice").order_by(IssuedPeerToken.issued_at.desc()).limit(2)).scalars()
    finally:
        engine.dispose()
    # asked for at half-life (the keeper looks every few seconds), well before the old token expired
    assert LIFETIME * 0.45 <= (renewed - previous).total_seconds() <= LIFETIME * 0.75, (previous, renewed)
    assert deployment.processes["alice"].poll() is None


@needs_chromium
def test_with_the_coordinator_down_the_status_page_says_so_and_a_ban_still_cuts_the_peer_off(deployment):
    url = f"{deployment.url}/runs/{deployment.slug}"
    with launch_chromium() as browser:
        page = browser.new_page()
        navigations = []
        page.on("framenavigated", lambda frame: navigations.append(frame.url))
        page.goto(url)
        assert page.locator("#status-coordinators tbody td.up").count() == 1
        assert page.locator("#status-notice").is_hidden()

        deployment.stop("coordinator")
        page.wait_for_selector("#status-coordinators tbody td.down", timeout=15_000)
        assert page.locator("#status-coordinators tbody td.up").count() == 0
        assert "no coordinator of run 'test' is up (last heartbeat" in page.locator("#status-notice").inner_text()
        assert status(deployment)["coordinators_up"] == 0

        banned_at = time.monotonic()
        done = deployment.cli("ban", deployment.slug, "bob")
        assert done.returncode == 0, done.stderr
        wait_for(lambda: "bob was banned from this run by its organizers: refused from now on" in log(
            deployment, "alice"), BAN_BOUND, "alice to refuse bob")
        print(f"ban to refusal with no coordinator up: {time.monotonic() - banned_at:.1f} s")
        code = deployment.wait_exit("bob", BAN_BOUND)
        # Cut off by whichever came first: his own peer reading the denylist, or the portal refusing his renewal.
        assert code != 0 and re.search(r"bob (was|is) banned from", log(deployment, "bob")), log(deployment, "bob")

        deployment.start_coordinator("coordinator-back")
        page.wait_for_selector("#status-coordinators tbody td.up", timeout=60_000)
        page.screenshot(path=str(deployment.logs / "status.png"), full_page=True)
        assert navigations == [url], "the page reloaded"
    assert deployment.processes["alice"].poll() is None


def test_the_portal_down_past_half_life_warns_and_trains_on_past_expiry_holds_and_trains_again_once_back(deployment):
    # Steady state first: the restarted coordinator has seen alice train, and she holds a fresh token, so the outage
    # below has a whole lifetime to show an epoch taken while the portal is down.
    epoch_back = swarm_epoch(deployment)
    wait_for(lambda: swarm_epoch(deployment) > epoch_back, 120, "the restarted coordinator to see alice train")
    issued = tokens_issued(deployment, "alice")
    wait_for(lambda: tokens_issued(deployment, "alice") > issued, 2 * LIFETIME, "alice to renew her token")
    deployment.stop("portal")
    epoch_down, renewed = swarm_epoch(deployment), tokens_issued(deployment, "alice")
    expires = query(deployment, select(func.max(IssuedPeerToken.expires_at)).where(
        IssuedPeerToken.username == "alice")).replace(tzinfo=timezone.utc)
    half_life = expires - timedelta(seconds=LIFETIME / 2)
    # Down past half-life: she warns and an epoch is taken meanwhile, before the token expires.
    wait_for(lambda: datetime.now(timezone.utc) > half_life and "cannot renew" in log(deployment, "alice")
             and swarm_epoch(deployment) > epoch_down,
             max((expires - datetime.now(timezone.utc)).total_seconds() - 5, 1),
             "an epoch and a renewal warning while the portal is down")
    warning = next(line for line in log(deployment, "alice").splitlines() if "cannot renew" in line)
    assert re.search(r"training goes on, the token expires in \d+ s; asking again in \d+ s$", warning), warning

    # Down past expiry: peers refuse an expired token, so she trains nothing (no epoch line for longer than two of her
    # epochs alone take, about 3 s each here), and her worker stays.
    wait_for(lambda: "token expired and the portal cannot renew it" in log(deployment, "alice"), LIFETIME,
             "alice's token to expire while the portal is down")
    time.sleep(3)  # the loop's step under way as the keeper said so may still end its epoch (one line)
    held_at = local_epoch(log(deployment, "alice"))
    time.sleep(10)
    assert local_epoch(log(deployment, "alice")) == held_at and deployment.processes["alice"].poll() is None
    held = next(line for line in log(deployment, "alice").splitlines() if "token expired" in line)
    assert held.endswith("training holds; asking the portal every 10 s, and training resumes once it answers"), held

    # Back: she renews and trains again, in a line each.
    deployment.start("portal-back", "-m", "app.cli", "serve")  # it takes a few seconds to answer
    resumed = re.compile(r"^training resumes$", re.MULTILINE)  # its own line (the held line names it too)
    wait_for(lambda: resumed.search(log(deployment, "alice")), 60, "alice to train again")
    text = log(deployment, "alice")
    assert 0 <= text.find("the portal is back: peer token renewed") < resumed.search(text).start(), text
    assert tokens_issued(deployment, "alice") > renewed
    wait_for(lambda: local_epoch(log(deployment, "alice")) > held_at, 60, "an epoch after the portal's return")
    assert deployment.processes["alice"].poll() is None
    assert "Traceback" not in log(deployment, "alice")
