"""the round model fitted from measured rounds, beside each averaging plan

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 03:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

COLUMNS = (('latency_seconds', sa.Float()), ('part_seconds', sa.Float()), ('fitted_rounds', sa.Integer()),
           ('fitted_seconds', sa.Float()))


def upgrade() -> None:
    for name, kind in COLUMNS:
        op.add_column('averaging_plans', sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    for name, _ in COLUMNS:
        op.drop_column('averaging_plans', name)  # native DROP COLUMN (SQLite 3.35+)
