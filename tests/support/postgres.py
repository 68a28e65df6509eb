"""A throwaway PostgreSQL cluster on loopback, from Debian's server binaries: the test suite's and the load
bench's production database."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def throwaway_postgres(bin_dir: Path, *settings: str) -> Iterator[str]:
    """Start a cluster in a temporary folder (as user postgres when run as root); yields its SQLAlchemy URL and
    removes it all afterwards. ``settings``: extra ``-c name=value`` server options."""
    root = Path(tempfile.mkdtemp(prefix="dedloc-pg-"))
    data, port = root / "data", _free_port()
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    shutil.chown(root, "postgres") if os.geteuid() == 0 else None
    run = lambda *args: subprocess.run([*as_postgres, *args], check=True, capture_output=True, timeout=120)
    options = " ".join([f"-p {port} -k {root} -c listen_addresses=127.0.0.1", *(f"-c {s}" for s in settings)])
    run(str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust")
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-o", options, "start")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)
