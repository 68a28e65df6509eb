"""what an aggregator cut from a sender (robust aggregation), on its receipt

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01 05:20:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('receipts', sa.Column('attestation', sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column('receipts', 'attestation')  # native DROP COLUMN (SQLite 3.35+): no table copy, no cascade
