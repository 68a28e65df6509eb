"""Volunteers behind a router, in network namespaces (bench/netns.py): with no flags, a worker on an open
host is found reachable and stays a full peer; one behind a masquerading home router is found unreachable,
switches to client mode by itself, trains and is credited; when that one's link goes down for 30 s and comes back,
it rejoins without a restart and is credited again. Portal and coordinator run on this machine's leg of the
switch; both tests share one swarm (olga on the open host, hana at home)."""

from __future__ import annotations

import shutil
import sys
import time

import pytest
from dedloc_worker.session import CREDENTIAL_ENV
from sqlalchemy import select

from app.core.database import make_engine, make_sessionmaker
from app.core.processes import spawn
from app.models import Contribution, Peer
from bench import netns
from tests.support.harness import Deployment, local_epoch, wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.skipif(netns.unavailable() is not None,
                                                    reason=str(netns.unavailable()))]


@pytest.fixture(scope="module")
def internet():
    net = netns.Internet()
    yield net
    net.close()


@pytest.fixture(scope="module")
def deployment(internet, tmp_path_factory, output_dir):
    logs = output_dir / "logs" / "test_reachability_netns"
    shutil.rmtree(logs, ignore_errors=True)
    deployed = Deployment(tmp_path_factory.mktemp("netns"), logs)
    deployed.env["DEDLOC_HOST"] = netns.SERVER  # portal and coordinator on the switch, where the hosts reach them
    deployed.env["DEDLOC_PLAN_INTERVAL"] = "5"
    deployed.url = f"http://{netns.SERVER}:{deployed.port}"
    yield deployed
    deployed.close()


@pytest.fixture(scope="module")
def swarm(deployment, internet):
    """The run, portal and coordinator; olga on the open host founds it, then hana joins from home."""
    deployment.create_run(target_batch_size=2048)
    deployment.start_servers()
    start_worker_on(deployment, internet, "open", "olga")
    deployment.wait_for_founder("olga", timeout=150)
    start_worker_on(deployment, internet, "home", "hana")
    return deployment


def start_worker_on(deployment, internet, host: str, username: str):
    """``dedloc-worker join`` with no role flag, inside ``host``'s namespace, listening on all its addresses."""
    proc = spawn(["ip", "netns", "exec", internet.ns(host), sys.executable, "-m", "dedloc_worker", "join",
                  deployment.url, "--run", deployment.slug, "--listen", "/ip4/0.0.0.0/tcp/0", "--threads", "1"],
                 log=deployment.logs / f"{username}.log",
                 env={**deployment.env, CREDENTIAL_ENV: deployment.credential(username)}, cwd=deployment.workdir)
    deployment.processes[username] = proc


def rows(deployment, statement) -> list:
    engine = make_engine(deployment.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            return list(session.execute(statement))
    finally:
        engine.dispose()


def credited_epochs(deployment, username: str) -> list[int]:
    return [epoch for (epoch,) in rows(deployment, select(Contribution.epoch).where(
        Contribution.username == username, Contribution.credited > 0))]


def log(deployment, name: str) -> str:
    return (deployment.logs / f"{name}.log").read_text()


def test_an_open_host_stays_a_full_peer_and_one_behind_nat_becomes_a_client_by_itself(swarm):
    deployment = swarm
    wait_for(lambda: "switching to client mode" in log(deployment, "hana"), 120, "hana's verdict")
    [verdict] = [line for line in log(deployment, "hana").splitlines() if "unreachable from outside" in line]
    assert "connection refused" in verdict and f"the worker announced {netns.HOME}" in verdict, verdict
    assert f"the portal sees it at {netns.ROUTER_WAN}" in verdict, verdict
    assert f"reachable: peers can connect to this machine ({netns.OPEN}:" in log(deployment, "olga")

    wait_for(lambda: credited_epochs(deployment, "hana"), 150, "hana's first credited epoch")
    # Counted once hana's metrics record, published as her first epoch closes, carries the verdict.
    counts = lambda: (lambda p: (p["online"], p["reachable"], p["unreachable"], p["client"]))(  # noqa: E731
        deployment.get(f"/api/v1/runs/{deployment.slug}/status")["peers"])
    wait_for(lambda: counts() == (2, 1, 1, 0), 30, f"the status to count hana unreachable (now {counts()})")
    assert dict(rows(deployment, select(Peer.username, Peer.reachability))) == {
        "olga": "reachable", "hana": "unreachable"}  # what their /me rows show
    plan = wait_for(lambda: (lambda p: p if len(p["peers"]) == 2 else None)(
        deployment.get(f"/api/v1/runs/{deployment.slug}/plan")), 60, "a plan with both")
    assert {peer["username"]: peer["role"] for peer in plan["peers"]} == {"olga": "aggregator", "hana": "client"}


def test_a_worker_whose_link_was_down_30_s_rejoins_without_a_restart_and_is_credited_again(swarm, internet):
    deployment = swarm
    hana = deployment.processes["hana"]
    wait_for(lambda: credited_epochs(deployment, "hana"), 240, "hana's first credited epoch")
    before = len(log(deployment, "hana"))

    internet.link("home", False)  # the cable pulled: hana's DHT calls fail, each drops its callee from her table
    try:
        time.sleep(30)
        assert hana.poll() is None, "hana exited while her link was down"
    finally:
        internet.link("home", True)
    back, at = time.monotonic(), local_epoch(log(deployment, "hana"))

    # A step she finishes from here on is recorded as epoch `at` or later; one credited means olga averaged with her
    # again (a receipt of hers) and the coordinator read her claim: she is back in the swarm, not training alone.
    credited = wait_for(lambda: [e for e in credited_epochs(deployment, "hana") if e >= at], 120,
                        f"an epoch hana took after her link returned (at epoch {at}) to be credited")
    recovered = time.monotonic() - back
    assert hana.poll() is None, "hana's worker exited: it must rejoin without a restart"
    assert deployment.processes["hana"] is hana
    assert "Traceback" not in log(deployment, "hana")
    # One line as she lost touch, one as she was back (their order: the last of each).
    since = log(deployment, "hana")[before:].splitlines()
    lost = [i for i, line in enumerate(since) if line.startswith("lost touch with the swarm: no peer answers")]
    rejoined = [i for i, line in enumerate(since) if line.startswith("back in touch with the swarm")]
    assert lost and rejoined and lost[-1] < rejoined[-1], "\n".join(since)
    print(f"hana: credited again {recovered:.0f} s after her link returned (epochs {sorted(credited)}); "
          f"{since[rejoined[-1]]}")
