"""Files the installed package carries (package data, found with importlib.resources): pages, static files,
migrations and the wheels volunteers download. From a checkout, the editable install maps the same names to the
top-level templates/ and migrations/ (setup.py)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def package_dir(package: str, *parts: str) -> Path:
    """A folder of package data as a real path (the wheel is installed unpacked, so no extraction is needed)."""
    return Path(str(files(package).joinpath(*parts)))


def templates_dir() -> Path:
    return package_dir("app.templates")


def static_dir() -> Path:
    return package_dir("app", "static")


def migrations_dir() -> Path:
    return package_dir("app.migrations")


def wheels_dir() -> Path:
    """The dedloc-common and dedloc-worker wheels built with this package (setup.py; `make setup` in a checkout)."""
    return package_dir("app", "wheels")
