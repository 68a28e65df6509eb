"""evaluations as their own series, kept when checkpoint archives are pruned

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 03:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('evaluations',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('samples', sa.BigInteger(), nullable=False),
    sa.Column('eval_loss', sa.Float(), nullable=False),
    sa.Column('evaluated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_evaluations_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_evaluations')),
    sa.UniqueConstraint('run_id', 'epoch', name=op.f('uq_evaluations_run_id_epoch'))
    )
    op.create_index(op.f('ix_evaluations_run_id'), 'evaluations', ['run_id'], unique=False)
    # The evaluations of the checkpoints still kept: the only ones a database from before this revision has.
    op.execute("INSERT INTO evaluations (run_id, epoch, samples, eval_loss, evaluated_at) "
               "SELECT run_id, epoch, samples, eval_loss, created_at FROM checkpoints WHERE eval_loss IS NOT NULL")


def downgrade() -> None:
    op.drop_index(op.f('ix_evaluations_run_id'), table_name='evaluations')
    op.drop_table('evaluations')
