"""initial schema: runs, coordinators, snapshots, contributions

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 09:38:35.551391
"""
from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('slug', sa.String(length=64), nullable=False),
    sa.Column('title', sa.String(length=200), nullable=False),
    sa.Column('task', sa.String(length=200), nullable=False),
    sa.Column('task_options', sa.JSON(), nullable=False),
    sa.Column('target_batch_size', sa.Integer(), nullable=False),
    sa.Column('batch_size', sa.Integer(), nullable=False),
    sa.Column('seed', sa.Integer(), nullable=False),
    sa.Column('optimizer', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs')),
    sa.UniqueConstraint('slug', name=op.f('uq_runs_slug'))
    )
    op.create_table('contributions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('peer_key', sa.String(length=64), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('username', sa.String(length=100), nullable=False),
    sa.Column('samples', sa.BigInteger(), nullable=False),
    sa.Column('loss_sum', sa.Float(), nullable=False),
    sa.Column('mini_steps', sa.Integer(), nullable=False),
    sa.Column('seconds', sa.Float(), nullable=False),
    sa.Column('recorded_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_contributions_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_contributions')),
    sa.UniqueConstraint('run_id', 'peer_key', 'epoch', name=op.f('uq_contributions_run_id_peer_key_epoch'))
    )
    with op.batch_alter_table('contributions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_contributions_run_id'), ['run_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_contributions_username'), ['username'], unique=False)

    op.create_table('coordinators',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('peer_id', sa.String(length=100), nullable=False),
    sa.Column('multiaddrs', sa.JSON(), nullable=False),
    sa.Column('known_peers', sa.JSON(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_coordinators_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_coordinators')),
    sa.UniqueConstraint('run_id', 'peer_id', name=op.f('uq_coordinators_run_id_peer_id'))
    )
    with op.batch_alter_table('coordinators', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_coordinators_run_id'), ['run_id'], unique=False)

    op.create_table('snapshots',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('taken_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('peers_online', sa.Integer(), nullable=False),
    sa.Column('samples_per_second', sa.Float(), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('samples_total', sa.BigInteger(), nullable=False),
    sa.Column('samples_accumulated', sa.BigInteger(), nullable=False),
    sa.Column('eta_seconds', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_snapshots_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_snapshots'))
    )
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_snapshots_run_id'), ['run_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_snapshots_taken_at'), ['taken_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_snapshots_taken_at'))
        batch_op.drop_index(batch_op.f('ix_snapshots_run_id'))

    op.drop_table('snapshots')
    with op.batch_alter_table('coordinators', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_coordinators_run_id'))

    op.drop_table('coordinators')
    with op.batch_alter_table('contributions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_contributions_username'))
        batch_op.drop_index(batch_op.f('ix_contributions_run_id'))

    op.drop_table('contributions')
    op.drop_table('runs')
