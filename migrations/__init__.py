"""Alembic migrations; shipped inside the package as ``app.migrations`` (setup.py)."""
