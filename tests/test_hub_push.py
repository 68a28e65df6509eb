"""Pushing a checkpoint to the Hugging Face Hub, tested up to the HTTP seam: a loopback server stands in for the
Hub's API and records what huggingface_hub sends (the real Hub is not reachable from the test machines)."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.coordinator.hub import HubPushError, push_checkpoint, push_stored
from tests.support.harness import free_port

REPO = "dedloc-org/tiny-albert"
TOKEN = "hf_test_token"
COMMIT_OID = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """The Hub API endpoints a push uses, on loopback; ``refuse`` answers 401 to everything. ``requests`` holds
    (method, path, headers, body) of each request, in order."""

    def __init__(self, refuse: bool = False):
        self.requests: list[tuple[str, str, dict, bytes]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                self.handle_request()

            def do_POST(self):
                self.handle_request()

            def handle_request(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                status, answer = hub.answer(self.command, self.path.split("?")[0], body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.refuse = refuse
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        if self.refuse:
            return 401, {"error": "Invalid credentials in Authorization header"}
        if method == "POST" and path == "/api/repos/create":
            request = json.loads(body)
            return 200, {"url": f"{self.url}/{request['organization']}/{request['name']}"}
        if method == "POST" and path == "/api/validate-yaml":
            return 200, {"errors": [], "warnings": []}
        if method == "POST" and path == f"/api/models/{REPO}/preupload/main":
            # Every file as a regular git blob: inline in the commit, no LFS or Xet upload.
            files = json.loads(body)["files"]
            return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                   for f in files]}
        if method == "POST" and path == f"/api/models/{REPO}/commit/main":
            return 200, {"commitUrl": f"{self.url}/{REPO}/commit/{COMMIT_OID}", "commitOid": COMMIT_OID}
        return 404, {"error": f"not served here: {method} {path}"}

    def commit(self) -> tuple[dict, dict[str, bytes]]:
        """The commit request's header and its files (path -> content)."""
        (body,) = [body for method, path, _, body in self.requests if path.startswith(f"/api/models/{REPO}/commit/")]
        lines = [json.loads(line) for line in body.decode().splitlines()]
        assert lines[0]["key"] == "header"
        assert all(line["key"] == "file" and line["value"]["encoding"] == "base64" for line in lines[1:])
        return lines[0]["value"], {line["value"]["path"]: base64.b64decode(line["value"]["content"])
                                   for line in lines[1:]}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def local_hub(monkeypatch):
    """Only the loopback server is a Hub: telemetry off (it would also fetch the agent-harness registry from the
    default endpoint), online mode on, no ambient token or endpoint. huggingface_hub reads these variables once, at
    import: its constants are set as well."""
    import huggingface_hub.constants

    for name, value in (("HF_HUB_DISABLE_TELEMETRY", True), ("HF_HUB_OFFLINE", False)):
        monkeypatch.setenv(name, str(int(value)))
        monkeypatch.setattr(huggingface_hub.constants, name, value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    servers: list[FakeHub] = []

    def start(refuse: bool = False) -> FakeHub:
        servers.append(FakeHub(refuse))
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", servers[-1].url)
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A tiny ALBERT masked-LM in Hugging Face format."""
    from transformers import AlbertConfig, AutoModelForMaskedLM

    folder = tmp_path_factory.mktemp("tiny-albert")
    config = AlbertConfig(vocab_size=64, embedding_size=8, hidden_size=16, num_hidden_layers=1,
                          num_attention_heads=2, intermediate_size=32, max_position_embeddings=32)
    AutoModelForMaskedLM.from_config(config).save_pretrained(folder)
    return folder


def test_a_checkpoint_is_pushed_with_a_model_card_naming_the_run_and_its_contributors(local_hub, model_folder):
    hub = local_hub()
    where = push_checkpoint(model_folder, REPO, token=TOKEN, run_title="Tiny ALBERT together",
                            run_url="https://dedloc.example/runs/tiny", contributors=[("alice", 1200), ("bob", 300)],
                            epoch=7, eval_loss=3.25, endpoint=hub.url, private=True)

    assert where == f"{hub.url}/{REPO}/commit/{COMMIT_OID}"
    assert [(method, path) for method, path, _, _ in hub.requests] == [
        ("POST", "/api/repos/create"), ("POST", "/api/validate-yaml"),
        ("POST", f"/api/models/{REPO}/preupload/main"), ("POST", f"/api/models/{REPO}/commit/main")]
    assert all(headers["authorization"] == f"Bearer {TOKEN}" for _, _, headers, _ in hub.requests)
    create = json.loads(hub.requests[0][3])
    assert create == {"name": "tiny-albert", "organization": "dedloc-org", "visibility": "private", "type": "model"}

    header, files = hub.commit()
    assert "epoch 7" in header["summary"]
    assert set(files) == {"config.json", "model.safetensors", "README.md"}
    assert files["model.safetensors"] == (model_folder / "model.safetensors").read_bytes()
    assert json.loads(files["config.json"])["model_type"] == "albert"
    card = files["README.md"].decode()
    assert card.startswith("---\n") and "library_name: transformers" in card and "- dedloc" in card
    assert "Tiny ALBERT together" in card and "https://dedloc.example/runs/tiny" in card
    assert "| alice | 1,200 |" in card and "| bob | 300 |" in card and "3.2500" in card


def test_a_refused_token_or_an_unreachable_hub_is_one_line(local_hub, model_folder):
    hub = local_hub(refuse=True)
    with pytest.raises(HubPushError) as refused:
        push_checkpoint(model_folder, REPO, token="hf_wrong", run_title="Tiny", run_url="", contributors=[],
                        epoch=1, eval_loss=None, endpoint=hub.url)
    message = str(refused.value)
    assert "\n" not in message and "HTTP 401" in message and "HF_TOKEN" in message
    assert not any("/commit/" in path for _, path, _, _ in hub.requests)

    with pytest.raises(HubPushError, match=r"^could not push to the Hub at http://127\.0\.0\.1:\d+: .*refused"):
        push_checkpoint(model_folder, REPO, token=TOKEN, run_title="Tiny", run_url="", contributors=[], epoch=1,
                        eval_loss=None, endpoint=f"http://127.0.0.1:{free_port()}")  # nothing listens there


def test_the_checkpointer_hook_pushes_the_stored_archive_and_survives_a_failed_push(local_hub, model_folder,
                                                                                    tmp_path, monkeypatch, capsys):
    from dedloc_worker.training.checkpoints import write_archive

    from app.core.database import make_engine, make_sessionmaker, migrate
    from app.models import Contribution
    from app.runs import registry

    url = f"sqlite:///{tmp_path / 'dedloc.sqlite3'}"
    migrate(url)
    sessions = make_sessionmaker(make_engine(url))
    with sessions() as session:
        run = registry.create_run(session, slug="tiny", title="Tiny run")
        for username, credited in (("carol", 500), ("dave", 0)):
            session.add(Contribution(run_id=run.id, peer_key=username, epoch=1, username=username, samples=500,
                                     loss_sum=1.0, mini_steps=1, seconds=1.0, credited=credited,
                                     held=500 - credited))
        session.commit()
    task = SimpleNamespace(save=lambda folder: [
        (Path(folder) / path.name).write_bytes(path.read_bytes()) for path in model_folder.iterdir()])
    archive = tmp_path / "epoch-000005.tar"
    write_archive(archive, task, [], {}, None, {"epoch": 5})
    config, options = SimpleNamespace(slug="tiny"), SimpleNamespace(hub_repo=REPO)

    hub = local_hub()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("DEDLOC_PUBLIC_URL", "https://dedloc.example/")
    assert push_stored(config, options, archive, sessions, epoch=5, eval_loss=None) == (
        f"{hub.url}/{REPO}/commit/{COMMIT_OID}")
    _, files = hub.commit()
    assert set(files) == {"config.json", "model.safetensors", "README.md"}  # not the training state
    card = files["README.md"].decode()
    assert "Tiny run" in card and "https://dedloc.example/runs/tiny" in card and "| carol | 500 |" in card
    assert "dave" not in card  # nothing credited

    monkeypatch.setenv("HF_ENDPOINT", local_hub(refuse=True).url)
    assert push_stored(config, options, archive, sessions, epoch=5, eval_loss=None) is None
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("could not push checkpoint 5 to the Hub: the Hub refused the token (HTTP 401)")
    assert archive.exists()
    assert push_stored(config, SimpleNamespace(hub_repo=None), archive, sessions, epoch=5, eval_loss=None) is None
