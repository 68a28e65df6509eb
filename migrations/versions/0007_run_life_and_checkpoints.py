"""a run's life (state, target, checkpoint options, creator), per-run organizers, checkpoints

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 03:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (no batch): SQLite's batch mode copies the table, and dropping the old runs table would
    # cascade to every row that references a run.
    op.add_column('runs', sa.Column('state', sa.String(length=20), nullable=False, server_default='active'))
    op.add_column('runs', sa.Column('target_epochs', sa.Integer(), nullable=True))
    op.add_column('runs', sa.Column('checkpoints', sa.JSON(), nullable=False, server_default='{}'))
    op.add_column('runs', sa.Column('created_by', sa.String(length=100), nullable=True))
    op.create_table('run_organizers',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('username', sa.String(length=100), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_organizers_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_run_organizers')),
    sa.UniqueConstraint('run_id', 'username', name=op.f('uq_run_organizers_run_id_username'))
    )
    with op.batch_alter_table('run_organizers', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_run_organizers_run_id'), ['run_id'], unique=False)
    op.create_table('checkpoints',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('samples', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('eval_loss', sa.Float(), nullable=True),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('file_name', sa.String(length=200), nullable=False),
    sa.Column('final', sa.Boolean(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_checkpoints_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints')),
    sa.UniqueConstraint('run_id', 'epoch', name=op.f('uq_checkpoints_run_id_epoch'))
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoints_run_id'), ['run_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_run_id'))
    op.drop_table('checkpoints')
    with op.batch_alter_table('run_organizers', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_organizers_run_id'))
    op.drop_table('run_organizers')
    for column in ('created_by', 'checkpoints', 'target_epochs', 'state'):
        op.drop_column('runs', column)  # native DROP COLUMN (SQLite 3.35+): no table copy, no cascade
