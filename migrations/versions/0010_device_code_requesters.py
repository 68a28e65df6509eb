"""where each device login was requested from, for the per-address rate limit

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 05:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('device_codes', sa.Column('requested_from', sa.String(length=64), nullable=True))
    op.create_index('ix_device_codes_requested_from_created_at', 'device_codes', ['requested_from', 'created_at'])


def downgrade() -> None:
    op.drop_index('ix_device_codes_requested_from_created_at', table_name='device_codes')
    with op.batch_alter_table('device_codes') as batch:
        batch.drop_column('requested_from')
