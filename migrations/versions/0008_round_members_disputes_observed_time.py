"""round members and observed time on contributions, disputes, snapshots by epoch

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 09:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN and CREATE INDEX (no batch): SQLite's batch mode copies a table, and dropping a copied table
    # that others reference would cascade to their rows.
    op.add_column('contributions', sa.Column('members', sa.JSON(), nullable=False, server_default='[]'))
    op.add_column('contributions', sa.Column('observed_seconds', sa.Float(), nullable=True))
    op.create_index('ix_snapshots_run_id_epoch', 'snapshots', ['run_id', 'epoch'], unique=False)
    op.create_table('disputes',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('group_id', sa.String(length=64), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('claim_key', sa.String(length=64), nullable=False),
    sa.Column('claimant', sa.String(length=100), nullable=False),
    sa.Column('claimed', sa.BigInteger(), nullable=False),
    sa.Column('aggregator_key', sa.String(length=64), nullable=False),
    sa.Column('author', sa.String(length=100), nullable=False),
    sa.Column('seen', sa.Float(), nullable=False),
    sa.Column('kind', sa.String(length=20), nullable=False),
    sa.Column('recorded_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_disputes_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_disputes')),
    sa.UniqueConstraint('run_id', 'group_id', 'claim_key', 'aggregator_key',
                        name=op.f('uq_disputes_run_id_group_id_claim_key_aggregator_key'))
    )
    op.create_index(op.f('ix_disputes_run_id'), 'disputes', ['run_id'], unique=False)
    op.create_index(op.f('ix_disputes_author'), 'disputes', ['author'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_disputes_author'), table_name='disputes')
    op.drop_index(op.f('ix_disputes_run_id'), table_name='disputes')
    op.drop_table('disputes')
    op.drop_index('ix_snapshots_run_id_epoch', table_name='snapshots')
    for column in ('observed_seconds', 'members'):
        op.drop_column('contributions', column)  # native DROP COLUMN (SQLite 3.35+): no table copy, no cascade
