"""The run's files (the organizer's data, the tokenizer the portal trained), downloaded once and cached by content:
``~/.cache/dedloc/files/<sha256>`` (``DEDLOC_CACHE`` moves it)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Dict, Iterable

import httpx
from dedloc_common.contract import API_PREFIX, RunFile

from dedloc_worker.errors import ConfigError, PortalError
from dedloc_worker.portal.client import tls


def cache_dir() -> Path:
    return Path(os.environ.get("DEDLOC_CACHE") or Path.home() / ".cache" / "dedloc") / "files"


def fetch_run_files(portal_url: str, slug: str, names: Iterable[str]) -> Dict[str, Path]:
    """Local paths of the named run files, downloading what the cache lacks; errors say which file."""
    names = list(names)
    if not names:
        return {}
    base = f"{portal_url.rstrip('/')}{API_PREFIX}/runs/{slug}/files"
    try:
        with httpx.Client(verify=tls(), timeout=60, follow_redirects=True) as client:
            listed = {f.name: f for f in map(RunFile.model_validate, client.get(base).raise_for_status().json())}
            paths = {}
            for name in names:
                if name not in listed:
                    raise ConfigError(f"the run names a file {name!r} its portal does not serve; tell its organizer")
                paths[name] = _cached(client, f"{base}/{name}", listed[name])
            return paths
    except httpx.HTTPError as e:
        raise PortalError(f"cannot download the run's files from {base} ({e}); retry in a minute") from None


def _cached(client: httpx.Client, url: str, file: RunFile) -> Path:
    target = cache_dir() / file.sha256
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    digest = hashlib.sha256()
    with client.stream("GET", url) as response, partial.open("wb") as out:
        response.raise_for_status()
        for chunk in response.iter_bytes(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != file.sha256:
        partial.unlink(missing_ok=True)
        raise PortalError(f"the run file {file.name!r} arrived damaged (sha256 mismatch); retry")
    partial.replace(target)
    return target
