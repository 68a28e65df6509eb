"""The OpenAPI document tells the truth: schemathesis fuzzes a live portal (``dedloc serve``) against its own
``/openapi.json``, and the answers it cannot see (datetimes, error bodies, ``Allow``, the device token endpoint)
are checked here directly."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.runs import registry
from app.runs.snapshots import record_snapshot
from app.web.main import create_app
from tests.support.factories import contribution, seed_credit
from tests.support.portal import credential_by_signing_in

CONFIG = Path(__file__).parent / "support" / "schemathesis.toml"
# Every check schemathesis 4 has but object_level_authorization ("one identity cannot read an object another
# created"): no operation of the API creates an object that is read back by id, so it has nothing to check (it
# needs two identities in a Web Fuzzing Commons auth file, and only warns without them). Where a schema cannot say
# enough (a valid RSA key, a device code nobody issued), tests/support/schemathesis.toml says so.
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance,negative_data_rejection,positive_data_acceptance,missing_required_header,"
          "unsupported_method,allow_header_conformance,use_after_free,ensure_resource_availability,ignored_auth")
EXAMPLES, SEED = 15, 20261201


def schemathesis(url: str, credential: str, *selection: str, output: Path, cwd: Path) -> subprocess.CompletedProcess:
    """One ``schemathesis run`` in its own process, its report kept under ``output``. One worker: on Python 3.11
    two threads parsing source at once (hypothesis describes its filters that way) can fail with CPython's
    "AST constructor recursion depth mismatch"."""
    done = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run", f"{url}/openapi.json",
         "--checks", CHECKS, "--max-examples", str(EXAMPLES), "--seed", str(SEED), "--workers", "1",
         "--no-color", "--header", f"Authorization: Bearer {credential}", "--request-timeout", "20", *selection],
        capture_output=True, text=True, timeout=240, cwd=cwd,  # its cache folder lands there
    )
    output.write_text(done.stdout + done.stderr)
    return done


def test_schemathesis_finds_no_failure_against_a_live_portal(deployment, output_dir):
    deployment.create_run()
    done = deployment.cli("export-stats")  # the dumps exist: /stats/{name} answers 200 as well as 404
    assert done.returncode == 0, done.stderr
    deployment.start_portal()
    # Credentials as volunteers get them: signed in on the portal, then a device login approved there.
    fuzzing, revoking = (credential_by_signing_in(deployment.url, name) for name in ("alice", "bob"))
    report = output_dir / "schemathesis"
    report.mkdir(exist_ok=True)
    # Revoking a credential ends the others' authenticated cases, so that operation runs alone, with its own.
    har = report / "api.har"
    everything = schemathesis(deployment.url, fuzzing, "--exclude-path", "/api/v1/me/credential",
                              "--report", "har", "--report-har-path", str(har),
                              output=report / "api.txt", cwd=deployment.workdir)
    assert everything.returncode == 0, everything.stdout[-6000:] + everything.stderr[-2000:]
    # Every status the portal answered the fuzzer with is one the document lists for that operation.
    seen = answered_statuses(json.loads(har.read_text()), httpx.get(f"{deployment.url}/openapi.json").json())
    undocumented = {(op, status) for op, statuses in seen.items() for status, listed in statuses.items()
                    if not listed}
    assert not undocumented, undocumented
    assert seen[("POST", "/api/v1/device/token")].keys() >= {"400"}, seen[("POST", "/api/v1/device/token")]
    assert sum(len(statuses) for statuses in seen.values()) > 40, seen
    generated, passed = map(int, re.search(r"(\d+) generated, (\d+) passed", everything.stdout).groups())
    assert generated == passed > 300  # 23 operations, each in several phases
    revoke = schemathesis(deployment.url, revoking, "--include-path", "/api/v1/me/credential",
                          output=report / "revoke.txt", cwd=deployment.workdir)
    assert revoke.returncode == 0, revoke.stdout[-6000:] + revoke.stderr[-2000:]


def answered_statuses(har: dict, document: dict) -> dict[tuple[str, str], dict[str, bool]]:
    """For each documented operation the fuzzer called: each status it got, and whether the document lists it."""
    templates = [(re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(path)) + "$"), path)
                 for path in document["paths"]]
    seen: dict[tuple[str, str], dict[str, bool]] = {}
    for entry in har["log"]["entries"]:
        method, path = entry["request"]["method"], urlsplit(entry["request"]["url"]).path
        path_template = next((template for pattern, template in templates if pattern.match(path)), None)
        operation = document["paths"].get(path_template, {}).get(method.lower())
        if operation is None:  # a method the path does not have: the 405s are checked below
            continue
        status = str(entry["response"]["status"])
        seen.setdefault((method, path_template), {})[status] = (
            status in operation["responses"] or "default" in operation["responses"])
    return seen


# what the fuzzer cannot see by itself -----------------------------------------------------------------------------

@pytest.fixture
def client(tmp_path):
    from app.core.database import make_engine, make_sessionmaker, migrate

    url = f"sqlite:///{tmp_path / 'dedloc.sqlite3'}"
    migrate(url)
    engine = make_engine(url)
    with make_sessionmaker(engine)() as session:
        run = registry.create_run(session, slug="demo", title="Demo run", target_batch_size=4096)
        seed_credit(session, run, "k1", "alice", contribution(0, 300))
        record_snapshot(session, run, taken_at=datetime.now(timezone.utc) - timedelta(minutes=1), peers_online=1,
                        samples_per_second=10.0, epoch=0, loss=1.0, samples_total=300, samples_accumulated=0,
                        eta_seconds=None)
    engine.dispose()
    with TestClient(create_app(Settings(database_url=url, data_dir=tmp_path))) as client:
        yield client


def offset_of(text: str) -> timedelta:
    moment = datetime.fromisoformat(text)
    assert moment.tzinfo is not None, f"{text} has no UTC offset"
    return moment.utcoffset()


def test_every_datetime_has_its_offset(client):
    [run] = client.get("/api/v1/runs").json()
    swarm = client.get("/api/v1/runs/demo/swarm").json()
    [leader] = client.get("/api/v1/runs/demo/leaderboard").json()
    user = client.get("/api/v1/users/alice").json()
    for text in (run["created_at"], swarm["updated_at"], leader["last_seen"], user["last_seen"],
                 user["runs"][0]["last_seen"]):
        assert offset_of(text) == timedelta(0)


def test_since_takes_rfc_3339_with_an_offset(client):
    taken = client.get("/api/v1/runs/demo/swarm").json()["updated_at"]
    earlier = (datetime.fromisoformat(taken) - timedelta(hours=1)).astimezone(timezone(timedelta(hours=2)))
    assert len(client.get("/api/v1/runs/demo/history", params={"since": earlier.isoformat()}).json()) == 1
    assert client.get("/api/v1/runs/demo/history", params={"since": taken}).json() == []
    for bad in ("0.5", "2026-01-01", "2026-01-01T00:00:00", "0001-01-01T00:00:00+01:00"):
        refused = client.get("/api/v1/runs/demo/history", params={"since": bad})
        assert refused.status_code == 422 and refused.json()["detail"].startswith("query.since: "), bad


def test_the_document_promises_the_error_body_the_portal_sends(client):
    document = client.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and schemas["ErrorOut"]["required"] == ["detail"]
    history = document["paths"]["/api/v1/runs/{slug}/history"]["get"]["responses"]
    assert history["422"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorOut"}
    assert history["404"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorOut"}
    assert isinstance(client.get("/api/v1/runs/demo/history?limit=0").json()["detail"], str)


def test_405_names_every_method_of_the_path(client):
    for path, allowed in (("/api/v1/runs/demo/link-probe", "GET, POST"), ("/api/v1/runs/demo", "GET"),
                          ("/api/v1/device/token", "POST"), ("/static/style.css", "GET, HEAD")):
        answer = client.request("TRACE", path)
        assert (answer.status_code, answer.headers.get("allow")) == (405, allowed), path


def test_device_token_answers_malformed_polls_as_rfc_6749_says(client):
    document = client.get("/openapi.json").json()["paths"]["/api/v1/device/token"]["post"]
    form = document["requestBody"]["content"]["application/x-www-form-urlencoded"]["schema"]
    assert document["requestBody"]["required"] and "422" not in document["responses"]
    form_schema = client.get("/openapi.json").json()["components"]["schemas"][form["$ref"].rsplit("/", 1)[1]]
    assert set(form_schema["required"]) == {"grant_type", "device_code"}
    empty = client.post("/api/v1/device/token", data={})
    assert empty.status_code == 400 and empty.json()["error"] == "invalid_request"
    assert empty.headers["cache-control"] == "no-store"
    other = client.post("/api/v1/device/token", data={"grant_type": "password", "device_code": "x"})
    assert other.status_code == 400 and other.json()["error"] == "unsupported_grant_type"
    unknown = client.post("/api/v1/device/token",
                          data={"grant_type": "urn:ietf:params:oauth:grant-type:device_code", "device_code": "x"})
    assert unknown.status_code == 400 and unknown.json()["error"] == "invalid_grant"
