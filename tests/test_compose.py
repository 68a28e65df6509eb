"""compose.yaml agrees with the Dockerfile, the `dedloc` command and the settings. No image can be built here (no
registry for base images is reachable), so the file is read as Compose reads it (variables from
deploy.env.example, as from an .env file) and checked piece by piece; the portal's health check runs for real."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import httpx
import pytest
import yaml

from app.cli.main import build_parser
from app.core.config import Settings
from app.core.processes import spawn, stop
from tests.support.harness import ROOT, free_port, wait_for

VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
DEDLOC_SERVICES = ("migrate", "portal", "coordinator")
HEALTH_CHECKS = {"serve": "portal-health", "coordinator": "coordinator-health"}  # long-running command -> its check


def example_env() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in (ROOT / "deploy.env.example").read_text().splitlines()
             if line.strip() and not line.startswith("#"))
    values = {name: value for name, value in pairs}
    # The required secrets are empty in the example: fill them as an operator would.
    return {**values, "POSTGRES_PASSWORD": "pg-secret", "DEDLOC_SECRET_KEY": "k" * 48}


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error} and ${VAR?error}."""

    def value(match: re.Match) -> str:
        name, operator, argument = match.groups()
        present = env.get(name)
        if operator in (":-", ":?") and not present or operator in ("-", "?") and present is None:
            if operator.endswith("?"):
                raise AssertionError(f"compose refuses to start without {name}: {argument}")
            return argument
        return present or ""

    return VARIABLE.sub(value, text.replace("$$", "\0")).replace("\0", "$")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(interpolate((ROOT / "compose.yaml").read_text(), example_env()))


@pytest.fixture(scope="module")
def dockerfile() -> dict:
    text = (ROOT / "Dockerfile").read_text()
    return {
        "targets": re.findall(r"^FROM \S+ AS (\S+)", text, re.M),
        "expose": re.findall(r"^EXPOSE (\d+)", text, re.M),
        "volumes": re.findall(r"^VOLUME (\S+)", text, re.M),
        "data_dir": re.search(r"DEDLOC_DATA_DIR=(\S+)", text).group(1),
        "pip": pip_steps(text),
    }


def pip_steps(text: str) -> dict[str, list[list[str]]]:
    """Each stage's `pip wheel` and `pip install` commands, in order, as argv lists without the `pip`."""
    steps: dict[str, list[list[str]]] = {}
    stage = None
    for line in text.replace("\\\n", " ").splitlines():
        if found := re.match(r"FROM \S+ AS (\S+)", line):
            stage = steps.setdefault(found.group(1), [])
        elif line.startswith("RUN "):
            for command in line[4:].split("&&"):
                argv = shlex.split(command)
                if argv[:1] == ["pip"] and argv[1:2] in (["wheel"], ["install"]):
                    stage.append(argv[1:])
    return steps


@pytest.fixture(scope="module")
def deploying() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme[readme.index("## Deploying"):readme.index("\n## ", readme.index("## Deploying") + 5)]


def environment(service: dict) -> dict[str, str]:
    return {name: str(value) for name, value in (service.get("environment") or {}).items()}


def test_every_dedloc_service_runs_a_real_command_from_the_right_image(compose, dockerfile):
    services = compose["services"]
    for name in DEDLOC_SERVICES:
        service = services[name]
        assert service["build"]["target"] in dockerfile["targets"], name
        command = service["command"]
        assert command[0] == "dedloc", name
        args = build_parser().parse_args(command[1:])  # an unknown subcommand or option exits here
        # The coordinator needs the swarm stack, which only the coordinator image has.
        wanted = "coordinator" if args.command == "coordinator" else "portal"
        assert service["build"]["target"] == wanted, name
    assert services["migrate"]["command"] == ["dedloc", "migrate"]
    assert services["portal"]["command"][:2] == ["dedloc", "serve"]


def health_command(service: dict) -> list[str]:
    """The health check's command, as Docker runs it (exec form: CMD then the argv)."""
    test = service.get("healthcheck", {}).get("test")
    assert test and test[0] == "CMD", f"{test}: not an exec-form health check"
    return test[1:]


def test_every_long_running_dedloc_service_checks_its_health_with_dedloc(compose):
    services = compose["services"]
    long_running = [name for name, service in services.items()
                    if service.get("command", [None])[0] == "dedloc" and service.get("restart") != "no"]
    assert {"portal", "coordinator"} <= set(long_running)
    parser = build_parser()
    for name in long_running:
        service = services[name]
        assert "healthcheck" in service, f"{name} runs for good but has no health check"
        check = health_command(service)
        assert check[0] == "dedloc", f"{name}'s health check is not a dedloc subcommand: {check}"
        checked = parser.parse_args(check[1:])  # an unknown subcommand or option exits here
        served = parser.parse_args(service["command"][1:])
        assert checked.command == HEALTH_CHECKS.get(served.command), \
            f"{name} runs `dedloc {served.command}` but checks `dedloc {checked.command}`"
        if served.command == "coordinator":
            assert checked.run == served.run, f"{name} serves run {served.run} but checks run {checked.run}"


def test_start_order_and_health_checks(compose, dockerfile):
    services = compose["services"]
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    for name, service in services.items():
        for needed, condition in (service.get("depends_on") or {}).items():
            condition = condition["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in services[needed], f"{name} waits for {needed}'s health, which has no check"
            elif condition == "service_completed_successfully":
                assert services[needed].get("restart") == "no", f"{needed} must be a one-shot step"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("portal", "coordinator"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    # The portal serves (and its check asks, reading DEDLOC_PORT) the port the image exposes and the proxy
    # forwards to.
    portal = services["portal"]
    port = environment(portal)["DEDLOC_PORT"]
    assert [port] == dockerfile["expose"] == portal["expose"]
    assert f"portal:{port}" in services["proxy"]["command"]


# What the Dockerfile's paths are in tests/test_install.py's steps; flags that change only speed or output.
IMAGE_PATHS = {"/wheels": "{wheels}", ".": "{source}", "/wheels/constraints.txt": "{constraints}",
               "/wheels/dedloc-*.whl": "{wheel}", "$(ls /wheels/dedloc-*.whl)[coordinator]": "{wheel}[coordinator]"}
COSMETIC_FLAGS = {"-q", "--quiet", "--no-compile", "--no-build-isolation"}


def substance(argv) -> list[str]:
    return [IMAGE_PATHS.get(part, part) for part in argv if part not in COSMETIC_FLAGS]


def test_the_image_builds_and_installs_the_package_as_the_install_test_does(dockerfile):
    from tests.test_install import PIP_INSTALL, PIP_WHEEL

    pip = dockerfile["pip"]
    assert [substance(step) for step in pip["build"]] == [substance(PIP_WHEEL)]
    assert [substance(step) for step in pip["portal"]] == [substance(PIP_INSTALL)]
    # The coordinator stage: the same install step, for pinned torch first and then the package with its extra.
    install = substance(PIP_INSTALL)
    torch_pin = re.search(r"^torch==\S+", (ROOT / "constraints.txt").read_text(), re.M).group(0)
    assert [substance(step) for step in pip["coordinator"]] == [
        [*install[:-1], torch_pin], [*install[:-1], f"{install[-1]}[coordinator]"]]


def test_the_portal_may_open_a_socket_for_every_stream_it_serves(compose, monkeypatch):
    portal = compose["services"]["portal"]
    for variable, value in environment(portal).items():
        monkeypatch.setenv(variable, value)
    streams = Settings().max_event_streams
    soft = portal["ulimits"]["nofile"]["soft"]
    assert soft >= streams + 1000, f"open files {soft}: too few for {streams} streams and the rest of a process"
    assert portal["ulimits"]["nofile"]["hard"] >= soft


def test_one_data_volume_is_every_dedloc_containers_data_dir(compose, dockerfile):
    declared = set(compose["volumes"])
    for name, service in compose["services"].items():
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            assert source in declared, f"{name} mounts undeclared volume {source}"
    for name in DEDLOC_SERVICES:
        service = compose["services"][name]
        data_dir = environment(service)["DEDLOC_DATA_DIR"]
        assert data_dir == dockerfile["data_dir"] and [data_dir] == dockerfile["volumes"], name
        assert f"data:{data_dir}" in service["volumes"], f"{name} does not share the data volume"


def test_every_variable_is_a_setting_and_documented(compose, deploying, monkeypatch):
    settings = {f"DEDLOC_{field.upper()}" for field in Settings.model_fields} | {"DATABASE_URL"}
    read_in_code = set(re.findall(r'environ(?:\.get)?\(\s*"(DEDLOC_[A-Z_]+)"',
                                  "\n".join(p.read_text() for p in (ROOT / "app").rglob("*.py"))))
    for name, service in compose["services"].items():
        env = environment(service)
        for variable in env:
            if variable.startswith("DEDLOC_"):
                assert variable in settings | read_in_code, f"{name} sets {variable}, which nothing reads"
            assert f"`{variable}`" in deploying, f"README's Deploying section does not describe {variable}"
        if name in DEDLOC_SERVICES:
            for variable, value in env.items():
                monkeypatch.setenv(variable, value)
            Settings()  # every value parses as the setting it sets
            for variable in env:
                monkeypatch.delenv(variable)
    # And every variable an operator sets in .env.
    for variable in {match.group(1) for match in VARIABLE.finditer((ROOT / "compose.yaml").read_text())}:
        assert f"`{variable}`" in deploying, f"README's Deploying section does not describe {variable}"
        assert variable in example_env(), f"deploy.env.example does not list {variable}"


def test_the_coordinator_announces_the_port_it_listens_on_and_publishes(compose):
    from app.coordinator.addresses import announced_maddrs

    coordinator = compose["services"]["coordinator"]
    command = coordinator["command"]
    listen = command[command.index("--listen") + 1]
    [announced] = json.loads(environment(coordinator)["DEDLOC_ANNOUNCE_MADDRS"])
    assert announced_maddrs([announced], listen) == [announced]
    port = listen.rsplit("/", 1)[1]
    assert announced.endswith(f"/tcp/{port}") and listen.startswith("/ip4/0.0.0.0/")
    assert coordinator["ports"] == [f"{port}:{port}"]


def test_the_portal_health_check_passes_against_dedloc_serve(compose, tmp_path):
    """The portal container's command and check, run here: its environment but this machine's database,
    folder and loopback."""
    portal = compose["services"]["portal"]
    port = free_port()
    env = {**environment(portal), "DATABASE_URL": "", "DEDLOC_DATA_DIR": str(tmp_path), "DEDLOC_HOST": "127.0.0.1",
           "DEDLOC_PORT": str(port)}
    migrate = subprocess.run([sys.executable, "-m", "app.cli", *compose["services"]["migrate"]["command"][1:]],
                             env={**os.environ, **env}, capture_output=True, text=True,
                             timeout=120)
    assert migrate.returncode == 0, migrate.stderr
    server = spawn([sys.executable, "-m", "app.cli", *portal["command"][1:]], env=env, log=tmp_path / "portal.log")
    check = health_command(portal)
    assert check[0] == "dedloc"

    def health() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "app.cli", *check[1:]], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=30)

    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200, 60, "the portal")
        done = health()
        assert done.returncode == 0, done.stderr
    finally:
        stop(server)
    down = health()
    assert down.returncode == 1
    lines = down.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}/healthz" in lines[0], down.stderr
