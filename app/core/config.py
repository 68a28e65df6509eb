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
    # Web processes `dedloc serve` starts on the port (uvicorn's workers); `--workers` overrides it.
    web_processes: int = Field(1, ge=1)
    # Multiaddrs the coordinator announces to the swarm and registers for workers, as a JSON list, e.g.
    # '["/dns4/swarm.example.org/tcp/31337"]': where peers reach it from outside (a container's own addresses are
    # not). Each names its port; `dedloc coordinator --announce` overrides it.
    announce_maddrs: list[str] = Field(default_factory=list)
    # Seconds between two polls of the DHT by the coordinator's monitor.
    poll_interval: float = Field(2.0, gt=0)
    # Least seconds between two averaging plans when peers join (a plan naming a peer that left is replaced
    # at once): a volunteer whose machine flaps must not cause a plan storm.
    plan_interval: float = Field(30.0, ge=0)
    # A coordinator whose heartbeat is older than this (seconds) is not offered to joining workers.
    coordinator_timeout: float = Field(30.0, gt=0)
    # Seconds between two server-sent updates of a dashboard: under the coordinator's poll interval, so every
    # snapshot reaches every viewer within about a second plus the fan-out.
    live_interval: float = Field(1.0, gt=0)
    # Open dashboard streams one web process serves; past it a viewer gets 503 + Retry-After (each stream costs a
    # socket and a little memory, never a database connection): the process's open-file limit must be above it.
    max_event_streams: int = Field(10000, gt=0)
    # A viewer whose socket takes longer than this (seconds) to accept one update is dropped.
    event_send_timeout: float = Field(10.0, gt=0)
    # Database connection pool per process (SQLAlchemy's QueuePool, SQLite and PostgreSQL alike). A request holds a
    # connection only while its handler runs; a request that waits longer than db_pool_timeout gets 503.
    db_pool_size: int = Field(5, gt=0)
    db_max_overflow: int = Field(10, ge=0)
    db_pool_timeout: float = Field(10.0, gt=0)

    # Signs session cookies and encrypts runs' authority keys at rest. Empty: a random key kept in
    # data_dir/secret.key (fine for one machine; set it explicitly when several portals share a database).
    secret_key: str = ""
    # OpenID Connect provider (Hugging Face by default). Without a client id, only the loopback-only
    # development sign-in is offered.
    oidc_issuer: str = "https://huggingface.co"
    oidc_client_id: str = ""
    oidc_client_secret: str = ""
    # Empty: "openid profile read-org" for Hugging Face (organizations, for teams and org-only runs), "openid
    # profile" for other providers (app.identity.oidc.scopes).
    oidc_scopes: str = ""
    # Device logins (`dedloc-worker login`) one client address may start per minute; past it, 429.
    device_logins_per_minute: int = Field(20, gt=0)
    # Seconds an API credential (what `dedloc-worker login` stores) stays valid after its login; 0: until revoked.
    api_credential_lifetime: float = Field(0.0, ge=0)
    # Usernames that may create runs, change admission, ban and unban.
    organizers: list[str] = Field(default_factory=list)
    # Bytes of data files one run-creation form may upload, all files together; uploads stream to disk under
    # data_dir/uploads and are refused past this before more is read.
    max_upload_bytes: int = Field(1 << 30, gt=0)
    # Peer tokens: lifetime (seconds), and per-account limits.
    peer_token_lifetime: float = Field(3600.0, gt=0)
    peer_token_requests_per_minute: int = Field(30, gt=0)
    max_concurrent_peers: int = Field(8, gt=0)

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'dedloc.sqlite3').resolve()}"
