"""an event log of state changes with their causes; hosts remember their state across an outage

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 14:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),  # vm / host / migration / operation
        sa.Column("subject", sa.String(length=63), nullable=False),  # its name or id
        sa.Column("project_id", sa.Integer(), nullable=True),
        sa.Column("vm", sa.String(length=63), nullable=True),
        sa.Column("host", sa.String(length=63), nullable=True),
        sa.Column("old_state", sa.String(length=24), nullable=True),
        sa.Column("new_state", sa.String(length=24), nullable=True),
        sa.Column("cause", sa.String(length=128), nullable=False),  # user NAME (token T), libvirt event, ...
        sa.Column("message", sa.Text(), nullable=False, server_default=""),
    )
    op.create_index("ix_events_at", "events", ["at"])
    op.create_index("ix_events_vm", "events", ["vm"])
    op.create_index("ix_events_host", "events", ["host"])
    op.create_index("ix_events_project_id", "events", ["project_id"])
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("state_before_down", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_column("state_before_down")
    op.drop_table("events")
