"""serial console tickets (issue 31): single-use, short-lived, bound to a VM, a token and a session

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07 01:45:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_tickets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("vm_id", sa.Integer(), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("session_hash", sa.String(length=64), nullable=True),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.Column("used_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["vm_id"], ["vms.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("digest"),
    )
    op.create_index("ix_console_tickets_vm_id", "console_tickets", ["vm_id"])
    op.create_index("ix_console_tickets_expires_at", "console_tickets", ["expires_at"])


def downgrade() -> None:
    op.drop_table("console_tickets")
