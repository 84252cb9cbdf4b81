"""what each running VM's guest agent last said (issue 30): connected or none, and the guest's addresses

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07 01:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "guest_agents",
        sa.Column("vm_id", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("interfaces", sa.Text(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("changed_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["vm_id"], ["vms.id"]),
        sa.PrimaryKeyConstraint("vm_id"),
    )


def downgrade() -> None:
    op.drop_table("guest_agents")
