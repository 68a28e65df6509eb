"""Engine, sessions and migrations. SQLite runs in WAL mode so the portal and the coordinator share it."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.core.resources import migrations_dir


def make_engine(url: str, pool_size: int = 5, max_overflow: int = 10, pool_timeout: float = 30.0) -> Engine:
    """An engine with a bounded pool (``Settings.db_pool_*`` in the portal; SQLAlchemy's defaults elsewhere)."""
    pool = dict(pool_size=pool_size, max_overflow=max_overflow, pool_timeout=pool_timeout)
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30}, **(pool if path != ":memory:" else {}))
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True, **pool)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str):
    from alembic.config import Config

    config = Config(str(migrations_dir() / "alembic.ini"))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(url: str, revision: str = "head") -> None:
    """Bring the database to ``revision`` (creating a SQLite file if needed)."""
    from alembic import command

    make_engine(url).dispose()  # creates the SQLite folder
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


@contextmanager
def one_session(url: str, migrate_first: bool = True):
    """A session for one command: on the database migrated first (unless told not to: a health check reads the
    database as it is), its engine disposed after, so no connection outlives the command."""
    if migrate_first:
        migrate(url)
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as session:
            yield session
    finally:
        engine.dispose()
