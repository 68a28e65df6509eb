"""Command-line errors are one line that says what to do, with a distinct exit code; never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from dedloc_worker.session import CREDENTIAL_ENV

from tests.support.harness import Deployment, free_port

PLUGIN_RUN = "plugin"  # a run whose task no worker can load


@pytest.fixture(scope="module")
def portal(tmp_path_factory, output_dir):
    """One portal for the worker's refusals: run 'test', with no coordinator, and run 'plugin'."""
    workdir = tmp_path_factory.mktemp("cli")
    deployment = Deployment(workdir, output_dir / "logs" / "test_cli")
    deployment.create_run()
    assert deployment.cli("create-run", PLUGIN_RUN, "--task", "no_such_plugin:Task").returncode == 0
    deployment.start_portal()
    yield deployment
    deployment.close()


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_worker_with_an_unreachable_portal():
    done = run("-m", "dedloc_worker", "join", f"http://127.0.0.1:{free_port()}", "--run", "demo")
    assert done.returncode == 3
    assert "cannot reach the portal" in one_line(done.stderr)


def test_worker_asked_for_a_gpu_it_lacks_says_so_in_one_line():
    done = run("-m", "dedloc_worker", "join", f"http://127.0.0.1:{free_port()}", "--run", "demo", "--device", "cuda",
               env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert "--device cuda: this machine has no CUDA GPU" in one_line(done.stderr)


@pytest.mark.parametrize("devices", ["all", "0,1"])
def test_worker_asked_for_gpus_it_lacks_says_what_to_do_in_one_line(devices):
    done = run("-m", "dedloc_worker", "join", f"http://127.0.0.1:{free_port()}", "--run", "demo", "--devices", devices,
               env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    line = one_line(done.stderr)
    assert f"--devices {devices}: this machine has no CUDA GPU" in line
    assert "run without --devices to train on the CPU, or install a CUDA build of torch" in line


@pytest.mark.parametrize("args, words", [
    (["--devices", "foo"], "--devices 'foo': use all, or GPU indices separated by commas"),
    (["--devices", "all", "--device", "cpu"], "--devices trains on GPUs and --device cpu on the CPU"),
])
def test_worker_given_devices_it_cannot_use_says_so_in_one_line(args, words):
    done = run("-m", "dedloc_worker", "join", f"http://127.0.0.1:{free_port()}", "--run", "demo", *args)
    assert done.returncode == 2
    assert words in one_line(done.stderr)


def test_worker_with_an_unknown_run(portal):
    done = run("-m", "dedloc_worker", "join", portal.url, "--run", "no-such-run")
    assert done.returncode == 2
    assert "has no run named 'no-such-run'" in one_line(done.stderr)


def test_worker_without_a_coordinator_gives_up_with_a_reason(portal):
    done = run("-m", "dedloc_worker", "join", portal.url, "--run", portal.slug, "--wait", "1",
               env={CREDENTIAL_ENV: portal.credential("alice")})
    assert done.returncode == 3
    last = done.stderr.splitlines()[-1]
    assert "no coordinator of run 'test' has started yet" in last and "gave up after 1 s (--wait)" in last, last


def test_worker_given_a_task_it_cannot_load_says_so_in_one_line(portal):
    done = run("-m", "dedloc_worker", "join", portal.url, "--run", PLUGIN_RUN, "--wait", "1",
               env={CREDENTIAL_ENV: portal.credential("alice")})
    assert done.returncode == 2
    assert "cannot load task 'no_such_plugin:Task'" in one_line(done.stderr)


def test_create_run_refuses_a_bad_slug(tmp_path):
    done = run("-m", "app.cli", "create-run", "Not A Slug", env={"DEDLOC_DATA_DIR": str(tmp_path)})
    assert done.returncode == 2
    assert "must be lowercase letters" in one_line(done.stderr)


@pytest.mark.parametrize("options, named", [
    ('{"lr": -1}', "optimizer.lr: Input should be greater than 0"),
    ('{"algorithm": "gossip"}', "optimizer.algorithm: Input should be 'large-batch' or 'local-updates'"),
    ('{"algorithm": "local-updates", "outer_batch_size": 0}', "optimizer.outer_batch_size: Input should be greater"),
    ('{"algorithm": "local-updates", "outer_lr": -0.7}', "optimizer.outer_lr: Input should be greater than 0"),
    ('{"name": "adamw-4bit"}', "optimizer.name: Input should be 'adam', 'adamw', 'adamw-8bit' or 'lamb'"),
])
def test_create_run_refuses_bad_optimizer_options(tmp_path, options, named):
    done = run("-m", "app.cli", "create-run", "ok", "--optimizer", options, env={"DEDLOC_DATA_DIR": str(tmp_path)})
    assert done.returncode == 2
    assert named in one_line(done.stderr)
    control = run("-m", "app.cli", "create-run", "ok", env={"DEDLOC_DATA_DIR": str(tmp_path)})
    assert control.returncode == 0, control.stderr  # nothing of the refused run was stored


@pytest.mark.parametrize("options, files, named", [
    ({"model_type": "albrt"}, {"train.txt": "some text\n"}, "task_options.model.model_type: 'albrt' cannot be"),
    ({"model_type": "albert", "max_position_embeddings": 32}, {"train.txt": "text\n"}, "task_options.sequence_length"),
    ({"model_type": "albert"}, {"train.jsonl": '{"body": "no text column"}\n'}, "task_options.data.text_column"),
])
def test_create_run_names_the_bad_task_option_in_one_line(tmp_path, options, files, named):
    paths = []
    for name, body in files.items():
        (tmp_path / name).write_text(body)
        paths += ["--file", str(tmp_path / name)]
    task = {"model": options, "data": {"files": list(files)}, "tokenizer": {"train": {"vocab_size": 200}},
            "sequence_length": 64}
    done = run("-m", "app.cli", "create-run", "bad", "--task", "masked-lm", "--task-options", json.dumps(task),
               *paths, env={"DEDLOC_DATA_DIR": str(tmp_path / "data")})
    assert done.returncode == 2 and named in one_line(done.stderr), done.stderr
    # Nothing of the refused run stays: the slug is free, no file is kept.
    bad = tmp_path / "data" / "runs" / "bad"
    assert not bad.exists() or not any(bad.rglob("*.*"))
    control = run("-m", "app.cli", "create-run", "bad", env={"DEDLOC_DATA_DIR": str(tmp_path / "data")})
    assert control.returncode == 0, control.stderr


def test_a_target_in_samples_is_rounded_up_to_whole_steps(tmp_path):
    from app.core.database import make_engine, make_sessionmaker
    from app.runs import registry

    env = {"DEDLOC_DATA_DIR": str(tmp_path)}
    done = run("-m", "app.cli", "create-run", "by-samples", "--target-batch-size", "256", "--target-samples", "1000",
               env=env)
    assert done.returncode == 0, done.stderr
    engine = make_engine(f"sqlite:///{tmp_path / 'dedloc.sqlite3'}")
    try:
        with make_sessionmaker(engine)() as session:
            assert registry.get_run(session, "by-samples").target_epochs == 4  # 1000 / 256 = 3.9 steps
    finally:
        engine.dispose()
    refused = run("-m", "app.cli", "create-run", "none", "--target-samples", "0", env=env)
    assert refused.returncode == 2 and "target_epochs must be at least 1" in one_line(refused.stderr)


def test_create_run_is_idempotent_when_asked(tmp_path):
    env = {"DEDLOC_DATA_DIR": str(tmp_path)}
    assert run("-m", "app.cli", "create-run", "twice", env=env).returncode == 0
    again = run("-m", "app.cli", "create-run", "twice", env=env)
    assert again.returncode == 2 and "already exists" in one_line(again.stderr)
    assert run("-m", "app.cli", "create-run", "twice", "--if-missing", env=env).returncode == 0


def test_demo_refuses_a_taken_port(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run("-m", "app.cli", "demo", env={"DEDLOC_DATA_DIR": str(tmp_path), "DEDLOC_PORT": str(port)})
    assert done.returncode == 1
    assert f"port {port} on 127.0.0.1 is taken" in one_line(done.stderr)


def test_worker_with_a_revoked_credential_is_told_to_log_in_again(portal):
    done = run("-m", "dedloc_worker", "join", portal.url, "--run", portal.slug,
               env={CREDENTIAL_ENV: "dedloc_not-a-credential"})
    assert done.returncode == 6
    assert "dedloc-worker login" in one_line(done.stderr)


def test_a_banned_user_is_refused_a_token_with_the_reason(portal):
    credential = portal.credential("mallory")
    assert portal.cli("ban", portal.slug, "mallory", "--reason", "spam").returncode == 0
    done = run("-m", "dedloc_worker", "join", portal.url, "--run", portal.slug, env={CREDENTIAL_ENV: credential})
    assert done.returncode == 6
    assert "mallory is banned from run 'test'" in one_line(done.stderr)
