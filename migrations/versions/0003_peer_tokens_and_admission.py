"""peer tokens, run admission policy and authority keys, bans, allowlists

Revision ID: 0003
Revises: 0002
"""
from alembic import op
import sqlalchemy as sa

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("admission", sa.String(length=20), nullable=False, server_default="open"))
        batch_op.add_column(sa.Column("admission_org", sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column("authority_key_encrypted", sa.LargeBinary(), nullable=True))
    op.create_table(
        "peer_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("username", sa.String(length=100), nullable=False),
        sa.Column("peer_public_key", sa.Text(), nullable=False),
        sa.Column("peer_id", sa.String(length=100), nullable=False),
        sa.Column("issued_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_peer_tokens_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_peer_tokens")),
    )
    with op.batch_alter_table("peer_tokens", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_peer_tokens_run_id"), ["run_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_peer_tokens_username"), ["username"], unique=False)
        batch_op.create_index(batch_op.f("ix_peer_tokens_peer_id"), ["peer_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_peer_tokens_issued_at"), ["issued_at"], unique=False)
    op.create_table(
        "run_bans",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("username", sa.String(length=100), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("banned_by", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_run_bans_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run_bans")),
        sa.UniqueConstraint("run_id", "username", name=op.f("uq_run_bans_run_id_username")),
    )
    with op.batch_alter_table("run_bans", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_run_bans_run_id"), ["run_id"], unique=False)
    op.create_table(
        "run_allowlist",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("username", sa.String(length=100), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_run_allowlist_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run_allowlist")),
        sa.UniqueConstraint("run_id", "username", name=op.f("uq_run_allowlist_run_id_username")),
    )
    with op.batch_alter_table("run_allowlist", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_run_allowlist_run_id"), ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_table("run_allowlist")
    op.drop_table("run_bans")
    op.drop_table("peer_tokens")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("authority_key_encrypted")
        batch_op.drop_column("admission_org")
        batch_op.drop_column("admission")
