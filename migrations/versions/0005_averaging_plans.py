"""averaging plans the coordinator published

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29 12:55:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('averaging_plans',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('peers', sa.JSON(), nullable=False),
    sa.Column('vector_bytes', sa.BigInteger(), nullable=False),
    sa.Column('predicted_seconds', sa.Float(), nullable=False),
    sa.Column('lower_bound_seconds', sa.Float(), nullable=False),
    sa.Column('measured_seconds', sa.Float(), nullable=True),
    sa.Column('reason', sa.String(length=200), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_averaging_plans_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_averaging_plans'))
    )
    with op.batch_alter_table('averaging_plans', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_averaging_plans_run_id'), ['run_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_averaging_plans_created_at'), ['created_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('averaging_plans', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_averaging_plans_created_at'))
        batch_op.drop_index(batch_op.f('ix_averaging_plans_run_id'))
    op.drop_table('averaging_plans')
