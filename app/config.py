"""Settings: one object built at start-up from the environment (``DEDLOC_*``, ``DATABASE_URL``) and passed in."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DEDLOC_", extra="ignore")

    data_dir: Path = Field(Path("var"), description="database, coordinator identities, checkpoints")
    database_url: str = Field(
        "", validation_alias=AliasChoices("DATABASE_URL", "DEDLOC_DATABASE_URL"),
        description="SQLAlchemy URL; empty means SQLite in data_dir",
    )
    host: str = "127.0.0.1"
    port: int = 8000
    # Seconds between two polls of the DHT by the coordinator's monitor.
    poll_interval: float = Field(2.0, gt=0)
    # A coordinator whose heartbeat is older than this (seconds) is not offered to joining workers.
    coordinator_timeout: float = Field(30.0, gt=0)
    # Seconds between two server-sent updates of a dashboard.
    live_interval: float = Field(2.0, gt=0)

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'dedloc.sqlite3').resolve()}"
