"""The portal's build. One distribution, `dedloc`, holds the portal (app), the wire contract (dedloc_common, from
common/) and the swarm code the coordinator runs (dedloc_worker, from worker/); templates/ and migrations/ ship
inside it as app.templates and app.migrations. `pip install .` brings only the portal's dependencies; the
`coordinator` extra adds torch, hivemind and scipy. The wheels volunteers download (dedloc-common, dedloc-worker)
are built from common/ and worker/ into app/wheels, so an installed portal serves them without a source tree.
Metadata and dependencies: pyproject.toml."""

import tempfile
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
VOLUNTEER_SOURCES = ("common", "worker")


def build_volunteer_wheels(target: Path) -> None:
    """Pure-Python wheels through setuptools' own backend (no pip inside an isolated build)."""
    import os

    from setuptools import build_meta

    target.mkdir(parents=True, exist_ok=True)
    for source in VOLUNTEER_SOURCES:
        cwd = os.getcwd()
        with tempfile.TemporaryDirectory() as scratch:
            os.chdir(HERE / source)
            try:
                name = build_meta.build_wheel(scratch)
            finally:
                os.chdir(cwd)
            (Path(scratch) / name).replace(target / name)


class BuildWithVolunteerWheels(build_py):
    def run(self):
        super().run()
        if (HERE / "worker" / "pyproject.toml").exists():  # an sdist without worker/ keeps what it shipped
            build_volunteer_wheels(Path(self.build_lib) / "app" / "wheels")


if __name__ == "__main__":  # as setuptools runs it; `make setup` only borrows build_volunteer_wheels
    setup(
        packages=find_packages(include=["app*"]) + ["app.templates", "app.migrations", "app.migrations.versions"]
        + find_packages("common", include=["dedloc_common*"]) + find_packages("worker", include=["dedloc_worker*"]),
        package_dir={"app.templates": "templates", "app.migrations": "migrations",
                     "dedloc_common": "common/dedloc_common", "dedloc_worker": "worker/dedloc_worker"},
        package_data={
            "app": ["wheels/*.whl", "static/*.*", "static/vendor/*"],
            "app.templates": ["*.html"],
            "app.migrations": ["alembic.ini", "script.py.mako"],
        },
        cmdclass={"build_py": BuildWithVolunteerWheels},
    )
