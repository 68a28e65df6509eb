"""The installed package is the product: the portal's wheel, installed without -e into a fresh virtualenv outside
the checkout, migrates, serves its pages and the volunteers' wheels, and has neither torch nor hivemind."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import httpx
import pytest

from app.core.processes import spawn, stop

ROOT = Path(__file__).resolve().parent.parent

# Every portal module a web process may import (the coordinator, the planner and the demo are the swarm's side).
WEB_IMPORTS = ("import sys, app.web.main, app.cli.main, app.credit.stats_export; app.web.main.create_app(); "
               "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'hivemind', 'dedloc_worker')))")
# The package's build and install, as pip arguments: the Dockerfile's build and portal stages run the same steps
# (tests/test_compose.py compares them, ignoring only -q, --no-compile and --no-build-isolation).
PIP_WHEEL = ("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", "{wheels}", "{source}")
PIP_INSTALL = ("install", "-q", "--no-compile", "-c", "{constraints}", "{wheel}")


def pip_step(step: tuple[str, ...], **paths) -> list[str]:
    return [part.format(**paths) for part in step]


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A virtualenv holding the built dedloc wheel alone, and what it depends on (`pip install .`)."""
    root = tmp_path_factory.mktemp("installed")
    wheels = root / "wheels"
    run(sys.executable, "-m", "pip", *pip_step(PIP_WHEEL, wheels=wheels, source=ROOT))
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    (wheel,) = wheels.glob("dedloc-*.whl")
    run(python, "-m", "pip", *pip_step(PIP_INSTALL, constraints=ROOT / "constraints.txt", wheel=wheel))
    return env_dir


def test_the_installed_portal_serves_from_any_folder(installed, tmp_path):
    from tests.support.harness import free_port, wait_for

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    port = free_port()
    env = {"DEDLOC_DATA_DIR": str(tmp_path / "data"), "DEDLOC_PORT": str(port), "DATABASE_URL": "",
           "PATH": f"{installed / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": ""}
    dedloc = installed / "bin" / "dedloc"
    run(dedloc, "create-run", "probe", "--title", "Installed", cwd=elsewhere, env={**os.environ, **env})
    portal = spawn([str(dedloc), "serve"], log=tmp_path / "portal.log", env=env, cwd=elsewhere)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(f"{url}/healthz").status_code == 200, 60, "the installed portal")
        assert "Installed" in httpx.get(f"{url}/runs/probe").raise_for_status().text
        join = httpx.get(f"{url}/runs/probe/join").raise_for_status().text
        links = re.findall(rf"{url}/downloads/[\w.-]+\.whl", join)
        assert [link.rsplit("/", 1)[1].split("-")[0] for link in links] == ["dedloc_common", "dedloc_worker"]
        for link in links:
            wheel = httpx.get(link).raise_for_status()
            assert wheel.content[:2] == b"PK" and len(wheel.content) > 1000
        assert httpx.get(f"{url}/downloads/nothing.whl").status_code == 404
    finally:
        stop(portal)
    log = (tmp_path / "portal.log").read_text()
    assert "Traceback" not in log, log[-3000:]

    # The web portal alone: no deep-learning stack installed, and the web modules import without it.
    for package in ("torch", "hivemind", "dedloc-worker", "scipy"):
        shown = subprocess.run([installed / "bin" / "pip", "show", "-q", package], capture_output=True, text=True)
        assert shown.returncode != 0, f"{package} is installed with the portal"
    imported = run(installed / "bin" / "python", "-c", WEB_IMPORTS, cwd=elsewhere, env={**os.environ, **env})
    assert imported.stdout.strip() == "[]"
    location = run(installed / "bin" / "python", "-c", "import app; print(app.__file__)", cwd=elsewhere,
                   env={**os.environ, **env}).stdout
    assert str(installed) in location and str(ROOT) not in location

    # The worker's side, as installed, never imports the portal (it cannot run here without torch: read its code).
    site = Path(location.strip()).parent.parent
    for package in ("dedloc_worker", "dedloc_common"):
        sources = sorted((site / package).rglob("*.py"))
        assert sources, f"{package} is not in the installed package"
        for source in sources:
            tree = ast.parse(source.read_text())
            imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            assert not {m for m in imported if m.split(".")[0] == "app"}, f"{source} imports the portal"


def test_the_coordinator_extra_is_what_the_worker_needs():
    """The coordinator runs dedloc_worker's code from the portal's package: its extra must carry the worker's needs."""
    import tomllib
    from packaging.requirements import Requirement

    def names(requirements):
        return {Requirement(r).name.lower(): str(Requirement(r).specifier) for r in requirements}

    portal = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    worker = tomllib.loads((ROOT / "worker" / "pyproject.toml").read_text())["project"]
    common = tomllib.loads((ROOT / "common" / "pyproject.toml").read_text())["project"]
    coordinator = names(portal["optional-dependencies"]["coordinator"])
    needed = names(r for r in worker["dependencies"] if not r.startswith("dedloc-common"))
    assert needed and {n: coordinator.get(n) for n in needed} == needed
    assert names(common["dependencies"]).items() <= names(portal["dependencies"]).items()
