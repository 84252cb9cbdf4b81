"""high availability: each VM's HA policy and priority (an offering's default policy), placement groups,
hosts' fence agents, the reason for their state and since when they are down

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30 23:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "groups",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("policy", sa.String(length=16), nullable=False),
        sa.Column("hard", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_index("ix_groups_project_id", "groups", ["project_id"])
    with op.batch_alter_table("vms", schema=None) as batch_op:
        batch_op.add_column(sa.Column("ha_policy", sa.String(length=8), nullable=False, server_default="off"))
        batch_op.add_column(sa.Column("ha_priority", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("group_id", sa.Integer(), nullable=True))
        batch_op.create_foreign_key("fk_vms_group_id", "groups", ["group_id"], ["id"])
    with op.batch_alter_table("offerings", schema=None) as batch_op:
        batch_op.add_column(sa.Column("ha_policy", sa.String(length=8), nullable=False, server_default="off"))
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("fence_agents", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("state_reason", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("down_since", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_column("down_since")
        batch_op.drop_column("state_reason")
        batch_op.drop_column("fence_agents")
    with op.batch_alter_table("offerings", schema=None) as batch_op:
        batch_op.drop_column("ha_policy")
    with op.batch_alter_table("vms", schema=None) as batch_op:
        batch_op.drop_constraint("fk_vms_group_id", type_="foreignkey")
        batch_op.drop_column("group_id")
        batch_op.drop_column("ha_priority")
        batch_op.drop_column("ha_policy")
    op.drop_index("ix_groups_project_id", table_name="groups")
    op.drop_table("groups")
