"""coordinators' last stop, peers' reachability, reachability counts on snapshots

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 05:20:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (no batch), as in 0008: SQLite's batch mode would copy tables others reference.
    op.add_column('coordinators', sa.Column('stopped_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('peers', sa.Column('reachability', sa.String(length=20), nullable=False, server_default=''))
    op.add_column('snapshots', sa.Column('peers_client', sa.Integer(), nullable=False, server_default='0'))
    op.add_column('snapshots', sa.Column('peers_unreachable', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    op.drop_column('snapshots', 'peers_unreachable')
    op.drop_column('snapshots', 'peers_client')
    op.drop_column('peers', 'reachability')
    op.drop_column('coordinators', 'stopped_at')
