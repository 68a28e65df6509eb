"""Open statistics dumps, after volunteer-computing projects' daily user and team exports (BOINC's
``user.gz``/``team.gz``), in JSON and CSV, gzip-compressed.

Four files in one folder (``data_dir/stats`` is the one the portal serves under ``/stats/``):

- ``users.json.gz``: ``{"generated_at", "users": [{"username", "team", "samples", "held_samples",
  "runtime_seconds", "peers", "last_seen", "runs": [{"run", "samples", ...}]}]}``, most credited first;
- ``users.csv.gz``: ``username, team, run, samples, held_samples, runtime_seconds, peers, last_seen``, a row per
  user and run, and a row per user with an empty ``run`` for the totals across runs;
- ``teams.json.gz`` / ``teams.csv.gz``: the same per team, with ``members`` in place of ``username``.

Samples are credited samples; held samples are counted apart. Users hidden from public boards are left out,
from the team sums too. Each file is replaced atomically, so a download never sees half a dump.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Iterable, Optional

from sqlalchemy.orm import Session

from app.core.clock import as_utc
from app.credit.ledger import leaderboard
from app.credit.standings import Totals, team_leaderboard
from app.runs import registry

FILES = ("users.json.gz", "users.csv.gz", "teams.json.gz", "teams.csv.gz")
EXPORT_EVERY = timedelta(hours=24)
TOTAL_FIELDS = tuple(Totals.model_fields)  # samples, held_samples, runtime_seconds, peers, last_seen
USER_FIELDS = ("username", "team", "run", *TOTAL_FIELDS)
TEAM_FIELDS = ("team", "members", "run", *TOTAL_FIELDS)


def stats_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "stats"


def totals_dict(entry) -> dict:
    """The ``Totals`` fields of a board entry (a user's or a team's), ``last_seen`` in ISO 8601."""
    fields = {name: getattr(entry, name) for name in TOTAL_FIELDS}
    fields["last_seen"] = entry.last_seen.isoformat() if entry.last_seen else None
    return fields


def collect(session: Session) -> tuple[list[dict], list[dict]]:
    """(users, teams) as the JSON dumps list them: totals across runs and a ``runs`` list each."""
    boards = [(run.slug, {r.username: r for r in leaderboard(session, run, None)},
               {r.team: r for r in team_leaderboard(session, run, None)})
              for run in reversed(registry.list_runs(session))]
    users = [{"username": row.username, "team": row.team, **totals_dict(row),
              "runs": [{"run": slug, **totals_dict(by_user[row.username])}
                       for slug, by_user, _ in boards if row.username in by_user]}
             for row in leaderboard(session, None, None)]
    teams = [{"team": row.team, "members": row.members, **totals_dict(row),
              "runs": [{"run": slug, "members": by_team[row.team].members, **totals_dict(by_team[row.team])}
                       for slug, _, by_team in boards if row.team in by_team]}
             for row in team_leaderboard(session, None, None)]
    return users, teams


def csv_rows(entries: Iterable[dict], key: str) -> Iterable[dict]:
    """A row for each entry's totals (``run`` empty) and one for each of its runs."""
    for entry in entries:
        head = {name: entry[name] for name in (key, "team", "members") if name in entry}
        yield {**head, "run": "", **{name: entry[name] for name in TOTAL_FIELDS}}
        for per_run in entry["runs"]:
            yield {**head, **per_run}


def csv_text(rows: Iterable[dict], fields: tuple[str, ...]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows({name: "" if row.get(name) is None else row[name] for name in fields} for row in rows)
    return out.getvalue()


def write_gzip(path: Path, text: str, moment: datetime) -> None:
    """Write atomically (a temporary file renamed over the old one), stamped with ``moment``."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=int(moment.timestamp())) as out:
        out.write(text.encode())
    os.utime(temporary, (moment.timestamp(), moment.timestamp()))
    os.replace(temporary, path)


def export_stats(session: Session, out_dir: Path, now: Optional[datetime] = None) -> list[Path]:
    """Write the four dumps into ``out_dir`` (created if missing); returns their paths."""
    now = now or datetime.now(timezone.utc)
    users, teams = collect(session)
    generated = now.isoformat()
    contents = {
        "users.json.gz": json.dumps({"generated_at": generated, "users": users}, indent=1),
        "users.csv.gz": csv_text(csv_rows(users, "username"), USER_FIELDS),
        "teams.json.gz": json.dumps({"generated_at": generated, "teams": teams}, indent=1),
        "teams.csv.gz": csv_text(csv_rows(teams, "team"), TEAM_FIELDS),
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in contents.items():
        write_gzip(out_dir / name, text, now)
    return [out_dir / name for name in FILES]


def exported_at(out_dir: Path) -> Optional[datetime]:
    """When the last complete export was written (its oldest file), or None when a file is missing."""
    try:
        stamp = min((Path(out_dir) / name).stat().st_mtime for name in FILES)
    except FileNotFoundError:
        return None
    return datetime.fromtimestamp(stamp, timezone.utc)


def export_if_due(session_factory: Callable[[], Session], data_dir: Path, now: datetime) -> bool:
    """Export into ``data_dir/stats`` when the last export is older than a day (or missing); True when it did.

    Meant for the coordinator's loop: cheap when not due (four ``stat`` calls). Two coordinators exporting at
    once only write the same files twice.
    """
    now, last = as_utc(now), exported_at(stats_dir(data_dir))
    if last is not None and now - last < EXPORT_EVERY:
        return False
    with session_factory() as session:
        export_stats(session, stats_dir(data_dir), now)
    return True
