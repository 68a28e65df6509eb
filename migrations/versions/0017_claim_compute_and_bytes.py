"""contributions: seconds computing and payload bytes sent, as each worker reports them per epoch

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07 03:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMNs: batch mode would copy the table (pitfall of 0016's runs, the same here)
    op.add_column('contributions', sa.Column('compute_seconds', sa.Float(), nullable=True))
    op.add_column('contributions', sa.Column('sent_bytes', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column('contributions', 'sent_bytes')  # native DROP COLUMN (SQLite 3.35+)
    op.drop_column('contributions', 'compute_seconds')
