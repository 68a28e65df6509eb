"""users, API credentials and device logins (RFC 8628)

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("username", sa.String(length=100), nullable=False),
        sa.Column("oidc_subject", sa.String(length=255), nullable=True),
        sa.Column("oidc_issuer", sa.String(length=255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_users")),
        sa.UniqueConstraint("oidc_issuer", "oidc_subject", name=op.f("uq_users_oidc_issuer_oidc_subject")),
        sa.UniqueConstraint("username", name=op.f("uq_users_username")),
    )
    op.create_table(
        "api_credentials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("client_name", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], name=op.f("fk_api_credentials_user_id_users"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_credentials")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_credentials_token_hash")),
    )
    with op.batch_alter_table("api_credentials", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_credentials_user_id"), ["user_id"], unique=False)
    op.create_table(
        "device_codes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("device_code_hash", sa.String(length=64), nullable=False),
        sa.Column("user_code", sa.String(length=16), nullable=False),
        sa.Column("client_name", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("interval", sa.Integer(), nullable=False),
        sa.Column("last_polled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=True),
        sa.CheckConstraint("status IN ('pending', 'approved', 'denied', 'used')", name=op.f("ck_device_codes_status")),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], name=op.f("fk_device_codes_user_id_users"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_device_codes")),
        sa.UniqueConstraint("device_code_hash", name=op.f("uq_device_codes_device_code_hash")),
        sa.UniqueConstraint("user_code", name=op.f("uq_device_codes_user_code")),
    )


def downgrade() -> None:
    op.drop_table("device_codes")
    with op.batch_alter_table("api_credentials", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_credentials_user_id"))
    op.drop_table("api_credentials")
    op.drop_table("users")
