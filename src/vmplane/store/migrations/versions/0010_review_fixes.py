"""the review of 2026-12-02 (issue 26): the schema changes its fixes need, one section per finding

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06 12:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass
    # -- N6: a migration's cancel is persisted --
    with op.batch_alter_table("migrations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("cancel_requested", sa.Boolean(), nullable=False, server_default=sa.false()))
    # -- N2: volumes and the files they own --
    with op.batch_alter_table("volumes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("file_name", sa.String(length=128), nullable=True))
    op.execute("UPDATE volumes SET file_name = 'vmp-' || name || '.' || format")  # their files keep their names
    # -- N10: console sessions kept on the server --
    op.create_table(
        "console_sessions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("id_hash", sa.String(length=64), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["token_id"], ["tokens.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("id_hash"),
    )
    op.create_index("ix_console_sessions_token_id", "console_sessions", ["token_id"])
    op.create_index("ix_console_sessions_expires_at", "console_sessions", ["expires_at"])


def downgrade() -> None:
    pass
    # -- N10 --
    op.drop_index("ix_console_sessions_expires_at", table_name="console_sessions")
    op.drop_index("ix_console_sessions_token_id", table_name="console_sessions")
    op.drop_table("console_sessions")
    # -- N2 --
    with op.batch_alter_table("volumes", schema=None) as batch_op:
        batch_op.drop_column("file_name")
    # -- N6 --
    with op.batch_alter_table("migrations", schema=None) as batch_op:
        batch_op.drop_column("cancel_requested")
