"""vms belong to a zone (and maybe a cluster) and remember their boot memory; offerings and templates
can be retired

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 13:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("vms", schema=None) as batch_op:
        batch_op.add_column(sa.Column("zone_id", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("cluster_id", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("boot_memory_mib", sa.Integer(), nullable=True))
        batch_op.create_foreign_key("fk_vms_zone_id", "zones", ["zone_id"], ["id"])
        batch_op.create_foreign_key("fk_vms_cluster_id", "clusters", ["cluster_id"], ["id"])
        batch_op.create_index("ix_vms_zone_id", ["zone_id"])
    for table in ("offerings", "templates"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("retired", sa.Boolean(), nullable=False, server_default=sa.false()))
    # A VM placed before zones mattered belongs to the zone of its host; an unplaced one to the only
    # zone when there is exactly one (else it stays unscoped until it next starts).
    op.execute(
        "UPDATE vms SET zone_id = (SELECT clusters.zone_id FROM hosts JOIN clusters "
        "ON clusters.id = hosts.cluster_id WHERE hosts.id = vms.host_id) WHERE host_id IS NOT NULL"
    )
    op.execute(
        "UPDATE vms SET zone_id = (SELECT MIN(id) FROM zones) WHERE zone_id IS NULL "
        "AND (SELECT COUNT(*) FROM zones) = 1"
    )


def downgrade() -> None:
    for table in ("offerings", "templates"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("retired")
    with op.batch_alter_table("vms", schema=None) as batch_op:
        batch_op.drop_index("ix_vms_zone_id")
        batch_op.drop_constraint("fk_vms_cluster_id", type_="foreignkey")
        batch_op.drop_constraint("fk_vms_zone_id", type_="foreignkey")
        batch_op.drop_column("boot_memory_mib")
        batch_op.drop_column("cluster_id")
        batch_op.drop_column("zone_id")
