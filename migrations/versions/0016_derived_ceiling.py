"""runs: whether the samples-per-second ceiling is the organizer's, or derived from the swarm's measured rates

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 08:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None

OLD_DEFAULT = 5000.0  # what every run got unless its organizer chose a ceiling: such runs now derive theirs


def upgrade() -> None:
    # A plain ADD COLUMN: batch mode would copy the runs table, and its drop cascades to every run's rows on SQLite.
    op.add_column('runs', sa.Column('ceiling_from_organizer', sa.Boolean(), nullable=False,
                                    server_default=sa.false()))
    op.execute(sa.text('UPDATE runs SET ceiling_from_organizer = :yes WHERE samples_per_second_ceiling != :old')
               .bindparams(sa.bindparam('yes', True, type_=sa.Boolean()), old=OLD_DEFAULT))


def downgrade() -> None:
    op.drop_column('runs', 'ceiling_from_organizer')  # native DROP COLUMN (SQLite 3.35+)
