"""vms remember the host they last ran on (a delete asks it for a leftover domain); the event log is
indexed by (kind, subject) and operations by creation time (their history is pruned)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 17:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("vms", schema=None) as batch_op:
        batch_op.add_column(sa.Column("last_host_id", sa.Integer(), nullable=True))
        batch_op.create_foreign_key("fk_vms_last_host_id", "hosts", ["last_host_id"], ["id"])
    # a placed VM's last host is its host; a stopped one's is not known (a delete then asks its cluster's hosts)
    op.execute("UPDATE vms SET last_host_id = host_id WHERE host_id IS NOT NULL")
    op.create_index("ix_events_kind_subject", "events", ["kind", "subject"])
    op.create_index("ix_operations_created_at", "operations", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_operations_created_at", table_name="operations")
    op.drop_index("ix_events_kind_subject", table_name="events")
    with op.batch_alter_table("vms", schema=None) as batch_op:
        batch_op.drop_constraint("fk_vms_last_host_id", type_="foreignkey")
        batch_op.drop_column("last_host_id")
