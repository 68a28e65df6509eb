"""Fixtures shared by the test suite: an output folder, databases (SQLite and a throwaway PostgreSQL), a real
loopback deployment, portals and an OpenID Connect provider on loopback (sign-in tests), and a Chromium browser
(Playwright tests). Plain helpers live in tests/support/."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
from pathlib import Path

import pytest
from joserfc.jwk import RSAKey

from app.core.config import Settings
from app.core.database import make_engine, make_sessionmaker, migrate
from app.identity.device import DevicePolicy
from app.web.auth_routes import device_policy
from app.web.main import create_app
from tests.support.browsers import launch_chromium
from tests.support.harness import ROOT, Deployment
from tests.support.oidc_provider import LoopbackServer, OidcProvider
from tests.support.portal import CLIENT_ID, CLIENT_SECRET, QUICK, SECRET_KEY, Portal
from tests.support.postgres import postgres_bin, throwaway_postgres


@pytest.fixture(autouse=True, scope="module")
def _no_stray_event_loop():
    """Close an event loop a module's in-process hivemind objects left on the main thread (hivemind's MPFuture calls
    ``asyncio.get_event_loop()``, which on Python 3.11 creates one): dropped later, unclosed, it raised its
    ResourceWarnings in whichever test of another module ran the garbage collector next."""
    yield
    loop = getattr(asyncio.get_event_loop_policy()._local, "_loop", None)  # without creating one
    if loop is not None and not loop.is_running() and not loop.is_closed():
        loop.close()
        asyncio.set_event_loop(None)


@pytest.fixture(scope="session")
def output_dir() -> Path:
    """Where tests leave what a person may want to look at: screenshots, process logs."""
    path = Path(os.environ.get("DEDLOC_TEST_OUTPUT", ROOT / "test-output"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def deployment(tmp_path, output_dir, request):
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)
    logs = output_dir / "logs" / name
    shutil.rmtree(logs, ignore_errors=True)
    deployed = Deployment(tmp_path, logs)
    yield deployed
    deployed.close()


MIGRATED_TEMPLATE = "dedloc_migrated"  # a database migrated once per run; each test's is a copy of it


@pytest.fixture(scope="session")
def postgres_url():
    """A throwaway PostgreSQL cluster for this test run (skipped where the server binaries are missing), with a
    migrated template database."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL server binaries are not installed (apt-get install postgresql)")
    with throwaway_postgres(bin_dir) as url:
        run_sql(url, f"CREATE DATABASE {MIGRATED_TEMPLATE}")
        migrate(url.rsplit("/", 1)[0] + f"/{MIGRATED_TEMPLATE}")
        yield url


def run_sql(url: str, *statements: str) -> None:
    engine = make_engine(url)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        for statement in statements:
            connection.exec_driver_sql(statement)
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """An empty database URL on each engine the project supports."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'dedloc.sqlite3'}"
    base = request.getfixturevalue("postgres_url")
    name = f"t_{os.urandom(4).hex()}"
    run_sql(base, f"CREATE DATABASE {name}")
    return base.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture
def sessions(database_url, request):
    """A session factory on a migrated database (both engines): a copy of one migrated at the start of the run
    (migrating each test's took a minute of the suite; tests/test_database.py migrates from scratch)."""
    if database_url.startswith("sqlite"):
        shutil.copy(request.getfixturevalue("migrated_database"), database_url.removeprefix("sqlite:///"))
    else:
        base, name = request.getfixturevalue("postgres_url"), database_url.rsplit("/", 1)[1]
        run_sql(base, f"DROP DATABASE {name}", f"CREATE DATABASE {name} TEMPLATE {MIGRATED_TEMPLATE}")
    engine = make_engine(database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


# sign-in: an OpenID Connect provider and portals, on loopback -----------------------------------------------------

@pytest.fixture(scope="session")
def provider_key() -> RSAKey:
    return RSAKey.generate_key(2048, parameters={"kid": "test-session-key"})


@pytest.fixture(scope="session")
def provider_server(provider_key):
    provider = OidcProvider(provider_key, CLIENT_ID, CLIENT_SECRET)
    with LoopbackServer(provider.app) as server:
        provider.issuer = server.url
        yield provider


@pytest.fixture
def provider(provider_server) -> OidcProvider:
    provider_server.reset()
    return provider_server


@pytest.fixture(scope="session")
def migrated_database(tmp_path_factory) -> Path:
    """One migrated SQLite file; each portal gets a copy (faster than migrating for every test)."""
    path = tmp_path_factory.mktemp("template") / "dedloc.sqlite3"
    migrate(f"sqlite:///{path}")
    return path


@pytest.fixture
def start_portal(tmp_path, migrated_database):
    """Start a portal (real app, uvicorn, loopback) with the given settings; all are stopped after the test."""
    servers = contextlib.ExitStack()

    def start(policy: DevicePolicy = QUICK, **overrides) -> Portal:
        database = tmp_path / f"portal-{len(servers._exit_callbacks)}.sqlite3"
        shutil.copy(migrated_database, database)
        settings = Settings(database_url=f"sqlite:///{database}", data_dir=tmp_path, secret_key=SECRET_KEY,
                            **overrides)
        app = create_app(settings)
        app.dependency_overrides[device_policy] = lambda: policy
        server = servers.enter_context(LoopbackServer(app))
        return Portal(server.url, app)

    with servers:
        yield start


# a real browser -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chromium_browser():
    """Debian's Chromium driven by Playwright, shared by a module's tests (skip the module with
    ``needs_chromium``); each test opens its own context or page."""
    with launch_chromium() as browser:
        yield browser


@pytest.fixture
def page(chromium_browser):
    """A tab in a fresh browser context (no cookies from another test), closed after the test."""
    context = chromium_browser.new_context(viewport={"width": 1100, "height": 900})
    context.set_default_timeout(20_000)
    yield context.new_page()
    context.close()
