"""storage: pools, volumes (root disks and data volumes), the projects' storage quota and ledger,
templates with a root disk image, offerings with a root disk size

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 20:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pools",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("cluster_id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=True),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("capacity_mib", sa.Integer(), nullable=False),
        sa.Column("allocation_mib", sa.Integer(), nullable=False),
        sa.Column("available_mib", sa.Integer(), nullable=False),
        sa.Column("used_mib", sa.Integer(), nullable=False),
        sa.Column("shared_checked", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["cluster_id"], ["clusters.id"]),
        sa.ForeignKeyConstraint(["host_id"], ["hosts.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_index("ix_pools_cluster_id", "pools", ["cluster_id"])
    op.create_index("ix_pools_host_id", "pools", ["host_id"])
    op.create_table(
        "volumes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("pool_id", sa.Integer(), nullable=False),
        sa.Column("copy_pool_id", sa.Integer(), nullable=True),
        sa.Column("size_mib", sa.Integer(), nullable=False),
        sa.Column("format", sa.String(length=16), nullable=False),
        sa.Column("role", sa.String(length=8), nullable=False),
        sa.Column("template_id", sa.Integer(), nullable=True),
        sa.Column("vm_id", sa.Integer(), nullable=True),
        sa.Column("device", sa.String(length=8), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.ForeignKeyConstraint(["pool_id"], ["pools.id"]),
        sa.ForeignKeyConstraint(["copy_pool_id"], ["pools.id"]),
        sa.ForeignKeyConstraint(["template_id"], ["templates.id"]),
        sa.ForeignKeyConstraint(["vm_id"], ["vms.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_index("ix_volumes_project_id", "volumes", ["project_id"])
    op.create_index("ix_volumes_pool_id", "volumes", ["pool_id"])
    op.create_index("ix_volumes_vm_id", "volumes", ["vm_id"])
    op.create_index("ix_volumes_state", "volumes", ["state"])
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("quota_storage_mib", sa.Integer(), nullable=False, server_default=str(1024 * 1024))
        )
        batch_op.add_column(sa.Column("used_storage_mib", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("templates", schema=None) as batch_op:
        batch_op.add_column(sa.Column("disk_image", sa.String(length=1024), nullable=True))
        batch_op.add_column(sa.Column("disk_format", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("disk_mib", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("checksum", sa.String(length=64), nullable=True))
    with op.batch_alter_table("offerings", schema=None) as batch_op:
        batch_op.add_column(sa.Column("root_disk_mib", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("max_root_disk_mib", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("offerings", schema=None) as batch_op:
        batch_op.drop_column("max_root_disk_mib")
        batch_op.drop_column("root_disk_mib")
    with op.batch_alter_table("templates", schema=None) as batch_op:
        for column in ("checksum", "disk_mib", "disk_format", "disk_image"):
            batch_op.drop_column(column)
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.drop_column("used_storage_mib")
        batch_op.drop_column("quota_storage_mib")
    op.drop_table("volumes")
    op.drop_table("pools")
