"""peers: what the run needs in memory on each peer's device, as its metrics record says

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07 23:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('peers', sa.Column('memory', sa.JSON(), nullable=True))  # plain ADD COLUMN, as 0017


def downgrade() -> None:
    op.drop_column('peers', 'memory')  # native DROP COLUMN (SQLite 3.35+)
