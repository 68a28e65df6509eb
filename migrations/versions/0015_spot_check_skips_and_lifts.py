"""spot checks: drawn claims that could not be judged, and holds an organizer lifted

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 06:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('spot_checks', sa.Column('skipped', sa.String(length=20), server_default='', nullable=False))
    op.add_column('spot_checks', sa.Column('lifted_by', sa.String(length=100), nullable=True))


def downgrade() -> None:
    op.drop_column('spot_checks', 'lifted_by')  # native DROP COLUMN (SQLite 3.35+)
    op.drop_column('spot_checks', 'skipped')
