"""Alembic environment: migrations run against app.models' metadata, online only."""

from alembic import context

import app.identity.models  # noqa: F401  (registers the identity tables on Base.metadata)
from app.core.config import Settings
from app.core.database import make_engine
from app.models import Base

config = context.config
url = config.get_main_option("sqlalchemy.url") or Settings().resolved_database_url

engine = make_engine(url)
with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
