"""guest networks (issue 29): networks, NICs, security groups and their rules

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 19:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "networks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=True),
        sa.Column("zone_id", sa.Integer(), nullable=False),
        sa.Column("cidr", sa.String(length=43), nullable=False),
        sa.Column("gateway", sa.String(length=39), nullable=False),
        sa.Column("shared", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.ForeignKeyConstraint(["zone_id"], ["zones.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_index("ix_networks_project_id", "networks", ["project_id"])
    op.create_index("ix_networks_zone_id", "networks", ["zone_id"])
    op.create_table(
        "nics",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("vm_id", sa.Integer(), nullable=False),
        sa.Column("network_id", sa.Integer(), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("mac", sa.String(length=17), nullable=True),
        sa.Column("ip", sa.String(length=39), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["network_id"], ["networks.id"]),
        sa.ForeignKeyConstraint(["vm_id"], ["vms.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("mac"),
        sa.UniqueConstraint("network_id", "ip"),
        sa.UniqueConstraint("vm_id", "slot"),
    )
    op.create_index("ix_nics_vm_id", "nics", ["vm_id"])
    op.create_index("ix_nics_network_id", "nics", ["network_id"])
    op.create_table(
        "secgroups",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("project_id", "name"),
    )
    op.create_index("ix_secgroups_project_id", "secgroups", ["project_id"])
    op.create_table(
        "secgroup_rules",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("secgroup_id", sa.Integer(), nullable=False),
        sa.Column("direction", sa.String(length=3), nullable=False),
        sa.Column("proto", sa.String(length=8), nullable=False),
        sa.Column("port_min", sa.Integer(), nullable=True),
        sa.Column("port_max", sa.Integer(), nullable=True),
        sa.Column("cidr", sa.String(length=43), nullable=True),
        sa.Column("remote_group_id", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["secgroup_id"], ["secgroups.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["remote_group_id"], ["secgroups.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_secgroup_rules_secgroup_id", "secgroup_rules", ["secgroup_id"])
    op.create_table(
        "nic_secgroups",
        sa.Column("nic_id", sa.Integer(), nullable=False),
        sa.Column("secgroup_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["nic_id"], ["nics.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["secgroup_id"], ["secgroups.id"]),
        sa.PrimaryKeyConstraint("nic_id", "secgroup_id"),
    )
    op.create_index("ix_nic_secgroups_secgroup_id", "nic_secgroups", ["secgroup_id"])


def downgrade() -> None:
    op.drop_index("ix_nic_secgroups_secgroup_id", table_name="nic_secgroups")
    op.drop_table("nic_secgroups")
    op.drop_index("ix_secgroup_rules_secgroup_id", table_name="secgroup_rules")
    op.drop_table("secgroup_rules")
    op.drop_index("ix_secgroups_project_id", table_name="secgroups")
    op.drop_table("secgroups")
    op.drop_index("ix_nics_network_id", table_name="nics")
    op.drop_index("ix_nics_vm_id", table_name="nics")
    op.drop_table("nics")
    op.drop_index("ix_networks_zone_id", table_name="networks")
    op.drop_index("ix_networks_project_id", table_name="networks")
    op.drop_table("networks")
