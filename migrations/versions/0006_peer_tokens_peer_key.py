"""peer_tokens.record_key is peer_key, as everywhere else

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 10:00:00
"""
from alembic import op


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The index is dropped and made again so its name follows the column (PostgreSQL keeps an index's name through
    # a column rename). Two batches: SQLite's copy of the table cannot index a column renamed in the same batch.
    with op.batch_alter_table('peer_tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_peer_tokens_record_key'))
        batch_op.alter_column('record_key', new_column_name='peer_key')
    with op.batch_alter_table('peer_tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_peer_tokens_peer_key'), ['peer_key'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('peer_tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_peer_tokens_peer_key'))
        batch_op.alter_column('peer_key', new_column_name='record_key')
    with op.batch_alter_table('peer_tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_peer_tokens_record_key'), ['record_key'], unique=False)
