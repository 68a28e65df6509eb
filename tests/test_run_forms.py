"""Organizers create runs on the web (the new-run form, with uploaded data files) and change them on the organize
page: settings, pause / resume / finish, and the run's organizers. The real app on SQLite and PostgreSQL."""

from __future__ import annotations

import html
import json

import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.models import Run
from app.runs import files, registry
from app.web.main import create_app
from app.web.run_forms import EXAMPLE_MODEL, defaults
from tests.support.portal import form_token

TEXT = "\n".join(f"the quick brown fox {i} jumps over the lazy dog, line {i * 7}" for i in range(200)).encode()


@pytest.fixture
def app(database_url, sessions, tmp_path):
    with sessions() as session:
        registry.create_run(session, slug="demo", title="Demo run")
    app = create_app(Settings(database_url=database_url, data_dir=tmp_path, organizers=["olivia"]))
    with TestClient(app):  # runs the app's lifespan: its engine is disposed after the test
        yield app


def signed_in(app, username: str) -> TestClient:
    client = TestClient(app)
    signed = client.post("/signin/dev", data={"username": username, "csrf": form_token(client.get("/signin").text)},
                         follow_redirects=False)
    assert signed.status_code == 303, signed.text
    return client


def submit(client: TestClient, uploads: dict[str, bytes] | None = None, **changes):
    """The new-run form as the page offers it, with ``changes``, uploading ``uploads`` (name -> bytes)."""
    page = client.get("/runs/new")
    assert page.status_code == 200, page.text
    data = {**defaults(), "slug": "web-run", "title": "Web run", "csrf": form_token(page.text), **changes}
    sent = [("files", (name, body, "text/plain")) for name, body in (uploads or {"train.txt": TEXT}).items()]
    return client.post("/runs/new", data=data, files=sent, follow_redirects=False)


def slugs(sessions) -> list[str]:
    with sessions() as session:
        return sorted(run.slug for run in session.query(Run))


def test_the_example_is_the_demos_model():
    from app.cli.demo import DEMO_MODEL

    assert EXAMPLE_MODEL == DEMO_MODEL


def test_an_organizer_creates_a_run_with_its_files_and_becomes_its_organizer(app, sessions, tmp_path):
    olivia = signed_in(app, "olivia")
    assert 'id="new-run-link"' in olivia.get("/").text
    assert "DEDLOC_ORGANIZERS" in olivia.get("/runs/new").text and "1.0 GiB" in olivia.get("/runs/new").text
    created = submit(olivia, target_epochs="50")
    assert created.status_code == 303 and created.headers["location"] == "/runs/web-run"
    assert "Web run" in olivia.get("/runs/web-run").text and "Web run" in olivia.get("/").text
    with sessions() as session:
        run = registry.get_run(session, "web-run")
        assert (run.task, run.target_epochs, run.created_by) == ("masked-lm", 50, "olivia")
        assert registry.organizers(session, run) == ["olivia"]
    assert [f.name for f in files.listed(tmp_path, "web-run")] == ["train.txt", "tokenizer.json"]
    assert not any((tmp_path / "uploads").iterdir())  # the upload's scratch folder is gone


def task_with(model: dict, data: dict | None = None, **extra) -> str:
    return json.dumps({"model": {**EXAMPLE_MODEL, **model}, "data": data or {"files": ["train.txt"]},
                       "tokenizer": {"train": {"vocab_size": 200}}, "sequence_length": 64, **extra})


@pytest.mark.parametrize("task_options, uploads, named", [
    (task_with({"model_type": "albrt"}), None, "task_options.model.model_type"),
    (task_with({"max_position_embeddings": 32}), None, "task_options.sequence_length"),
    (task_with({}, {"files": ["train.jsonl"]}), {"train.jsonl": b'{"body": "no text column"}\n'},
     "task_options.data.text_column"),
    (task_with({}, {"files": ["train.jsonl"]}), {"train.jsonl": b'{"text": "a line"}\n{broken\n'},
     "task_options.data: train.jsonl is not well-formed jsonl"),
    (task_with({}, adapter={"rank": 0}), None, "task_options.adapter.rank"),
    (task_with({}, adapter={"rank": 8, "base_bits": 3}), None, "task_options.adapter.base_bits"),
])
def test_a_bad_task_option_is_named_the_form_kept_and_nothing_stored(app, sessions, tmp_path, task_options,
                                                                     uploads, named):
    olivia = signed_in(app, "olivia")
    refused = submit(olivia, uploads, task_options=task_options, slug="bad-run", batch_size="32")
    assert refused.status_code == 422 and named in html.unescape(refused.text), refused.text
    assert 'id="form-error"' in refused.text and 'value="bad-run"' in refused.text and 'value="32"' in refused.text
    assert task_options in html.unescape(refused.text)  # the options as typed
    assert slugs(sessions) == ["demo"] and not files.files_dir(tmp_path, "bad-run").exists()
    assert submit(olivia, slug="bad-run").status_code == 303  # control: the slug is free, the form works


@pytest.mark.parametrize("changes, named", [
    ({"batch_size": "many"}, "batch_size: 'many' is not a whole number"),
    ({"optimizer": "{lr: 1}"}, "optimizer: not JSON"),
    ({"optimizer": '{"lr": -1}'}, "optimizer.lr"),
    ({"optimizer": '{"delay_optimizer_step": false, "delay_grad_averaging": true}'},
     "delay_grad_averaging needs delay_optimizer_step"),
    ({"checkpoints": '{"keep": 0}'}, "checkpoints.keep"),
    ({"optimizer": '{"algorithm": "gossip"}'}, "optimizer.algorithm: Input should be 'large-batch' or 'local-updates'"),
    ({"optimizer": '{"algorithm": "local-updates", "outer_batch_size": 0}'}, "optimizer.outer_batch_size"),
    ({"optimizer": '{"algorithm": "local-updates", "outer_lr": -0.7}'}, "optimizer.outer_lr"),
    ({"slug": "new"}, "slug 'new' is the name of a portal page"),
    ({"task": "evil:Plugin"}, "task: use one of"),
    ({"title": "x" * 201}, "title must be 1 to 200 characters"),
])
def test_a_bad_form_value_is_named(app, sessions, changes, named):
    refused = submit(signed_in(app, "olivia"), **changes)
    assert refused.status_code == 422 and named in html.unescape(refused.text), refused.text
    assert slugs(sessions) == ["demo"]


def test_uploads_past_the_limit_are_refused_while_streaming(database_url, sessions, tmp_path):
    small = create_app(Settings(database_url=database_url, data_dir=tmp_path, organizers=["olivia"],
                                max_upload_bytes=1000))
    with TestClient(small):
        refused = submit(signed_in(small, "olivia"), {"train.txt": b"some text\n" * 500})
    assert refused.status_code == 413 and "DEDLOC_MAX_UPLOAD_BYTES" in refused.json()["detail"]
    assert slugs(sessions) == [] and not any((tmp_path / "uploads").iterdir())


def test_only_portal_organizers_create_runs(app, sessions):
    alice = signed_in(app, "alice")
    assert 'id="new-run-link"' not in alice.get("/").text
    assert alice.get("/runs/new").status_code == 403
    page = signed_in(app, "olivia").get("/runs/new").text  # a form alice saw somewhere: still refused
    refused = alice.post("/runs/new", data={**defaults(), "slug": "x", "csrf": form_token(page)},
                         files=[("files", ("train.txt", TEXT, "text/plain"))])
    assert refused.status_code == 403 and "DEDLOC_ORGANIZERS" in refused.json()["detail"]
    away = TestClient(app).get("/runs/new", follow_redirects=False)
    assert away.status_code == 303 and away.headers["location"].startswith("/signin")
    forged = signed_in(app, "olivia").post("/runs/new", data={**defaults(), "slug": "x", "csrf": "forged"},
                                           files=[("files", ("train.txt", TEXT, "text/plain"))])
    assert forged.status_code == 403 and slugs(sessions) == ["demo"]


def post_organize(client: TestClient, action: str, **data):
    page = client.get("/runs/demo/organize")
    assert page.status_code == 200, page.text
    return client.post(f"/runs/demo/organize/{action}", data={"csrf": form_token(page.text), **data},
                       follow_redirects=False)


def test_pause_resume_and_finish_reach_the_workers_join_config(app):
    olivia, worker = signed_in(app, "olivia"), TestClient(app)
    state = lambda: worker.get("/api/v1/runs/demo/join").json()["config"]["state"]
    assert state() == "active" and 'id="pause"' in olivia.get("/runs/demo/organize").text
    assert post_organize(olivia, "state", state="paused").status_code == 303 and state() == "paused"
    assert 'id="resume"' in olivia.get("/runs/demo/organize").text
    assert post_organize(olivia, "state", state="active").status_code == 303 and state() == "active"
    assert post_organize(olivia, "state", state="finished").status_code == 303 and state() == "finished"
    again = post_organize(olivia, "state", state="active")
    assert again.status_code == 422 and "is finished" in again.text and state() == "finished"
    assert post_organize(olivia, "state", state="gone").status_code == 422


def test_settings_change_only_when_every_value_is_good(app, sessions):
    olivia = signed_in(app, "olivia")
    changed = post_organize(olivia, "settings", title="Renamed", target_epochs="12",
                            optimizer='{"name": "lamb", "lr": 0.01}', checkpoints='{"every_epochs": 2}')
    assert changed.status_code == 303
    with sessions() as session:
        run = registry.get_run(session, "demo")
        changed = (run.title, run.target_epochs, run.optimizer["name"], run.optimizer["lr"])
        assert changed == ("Renamed", 12, "lamb", 0.01)
        assert (run.checkpoints["every_epochs"], run.checkpoints["keep"]) == (2, 3)  # defaults filled in
    refused = post_organize(olivia, "settings", title="Other", target_epochs="", optimizer='{"lr": -1}',
                            checkpoints="{}")
    assert refused.status_code == 422 and "optimizer.lr" in refused.text and 'value="Other"' in refused.text
    assert post_organize(olivia, "settings", title="Other", target_epochs="0").status_code == 422
    with sessions() as session:
        run = registry.get_run(session, "demo")
        assert (run.title, run.target_epochs, run.optimizer["lr"]) == ("Renamed", 12, 0.01)
    assert post_organize(olivia, "settings", title="Open-ended", target_epochs="").status_code == 303
    assert TestClient(app).get("/api/v1/runs/demo/join").json()["config"]["target_epochs"] is None


def test_an_added_organizer_may_organize_the_run_but_not_create_runs(app):
    olivia, bob = signed_in(app, "olivia"), signed_in(app, "bob")
    assert bob.get("/runs/demo/organize").status_code == 403
    assert post_organize(olivia, "organizers", username="bob").status_code == 303
    page = bob.get("/runs/demo/organize")
    assert page.status_code == 200 and "bob" in page.text
    assert 'id="organize-link"' in bob.get("/runs/demo").text
    assert post_organize(bob, "state", state="paused").status_code == 303
    assert bob.get("/runs/new").status_code == 403
