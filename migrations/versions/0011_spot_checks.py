"""spot checks: a peer's gradient recomputed on its own data, and the verdict

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01 05:10:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('spot_checks',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('peer_key', sa.String(length=64), nullable=False),
    sa.Column('username', sa.String(length=100), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('mini_steps', sa.Integer(), nullable=False),
    sa.Column('passed', sa.Boolean(), nullable=False),
    sa.Column('cosine', sa.Float(), nullable=False),
    sa.Column('norm_ratio', sa.Float(), nullable=False),
    sa.Column('claimed_loss', sa.Float(), nullable=False),
    sa.Column('recomputed_loss', sa.Float(), nullable=False),
    sa.Column('evidence', sa.String(length=300), nullable=False),
    sa.Column('checked_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_spot_checks_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_spot_checks')),
    sa.UniqueConstraint('run_id', 'peer_key', 'epoch', name=op.f('uq_spot_checks_run_id_peer_key_epoch'))
    )
    op.create_index(op.f('ix_spot_checks_run_id'), 'spot_checks', ['run_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_spot_checks_run_id'), table_name='spot_checks')
    op.drop_table('spot_checks')
