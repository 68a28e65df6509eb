"""accounting: credited and held samples, receipts, peers, users hidden and teams

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 10:38:26.044963
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('peers',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('peer_key', sa.String(length=64), nullable=False),
    sa.Column('username', sa.String(length=100), nullable=False),
    sa.Column('hardware', sa.String(length=200), nullable=False),
    sa.Column('first_seen', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_seen', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_peers_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_peers')),
    sa.UniqueConstraint('run_id', 'peer_key', name=op.f('uq_peers_run_id_peer_key'))
    )
    with op.batch_alter_table('peers', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_peers_run_id'), ['run_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_peers_username'), ['username'], unique=False)

    op.create_table('receipts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('aggregator_key', sa.String(length=64), nullable=False),
    sa.Column('group_id', sa.String(length=64), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('sender_peer_id', sa.String(length=100), nullable=False),
    sa.Column('weight', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_receipts_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_receipts')),
    sa.UniqueConstraint('run_id', 'aggregator_key', 'group_id', 'sender_peer_id', name=op.f('uq_receipts_run_id_aggregator_key_group_id_sender_peer_id'))
    )
    with op.batch_alter_table('receipts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_receipts_run_id'), ['run_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_receipts_group_id'), ['group_id'], unique=False)

    with op.batch_alter_table('contributions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('credited', sa.BigInteger(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('held', sa.BigInteger(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('reason', sa.String(length=300), nullable=True))
        batch_op.add_column(sa.Column('released_by', sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column('group_id', sa.String(length=64), nullable=False, server_default=''))
        batch_op.create_index(batch_op.f('ix_contributions_group_id'), ['group_id'], unique=False)
    # Rows written before receipts existed were credited in full.
    op.execute("UPDATE contributions SET credited = samples")

    with op.batch_alter_table('peer_tokens', schema=None) as batch_op:
        batch_op.add_column(sa.Column('record_key', sa.String(length=64), nullable=False, server_default=''))
        batch_op.create_index(batch_op.f('ix_peer_tokens_record_key'), ['record_key'], unique=False)

    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('samples_per_second_ceiling', sa.Float(), nullable=False, server_default='5000'))

    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.add_column(sa.Column('hidden', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('team', sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column('organizations', sa.JSON(), nullable=False, server_default='[]'))



def downgrade() -> None:
    with op.batch_alter_table('peer_tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_peer_tokens_record_key'))
        batch_op.drop_column('record_key')
    with op.batch_alter_table('contributions', schema=None) as batch_op:
        batch_op.drop_column('released_by')
        batch_op.drop_index(batch_op.f('ix_contributions_group_id'))
        batch_op.drop_column('group_id')
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.drop_column('organizations')
        batch_op.drop_column('team')
        batch_op.drop_column('hidden')

    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('samples_per_second_ceiling')

    with op.batch_alter_table('contributions', schema=None) as batch_op:
        batch_op.drop_column('reason')
        batch_op.drop_column('held')
        batch_op.drop_column('credited')

    with op.batch_alter_table('receipts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_receipts_group_id'))
        batch_op.drop_index(batch_op.f('ix_receipts_run_id'))

    op.drop_table('receipts')
    with op.batch_alter_table('peers', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_peers_username'))
        batch_op.drop_index(batch_op.f('ix_peers_run_id'))

    op.drop_table('peers')
