"""backups (issue 32): backup stores, backups of a VM's root disk with their checkpoints, the backup quota

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07 05:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "backup_stores",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("cluster_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["cluster_id"], ["clusters.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_index("ix_backup_stores_cluster_id", "backup_stores", ["cluster_id"])
    op.create_table(
        "backups",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("store_id", sa.Integer(), nullable=False),
        sa.Column("vm_id", sa.Integer(), nullable=True),
        sa.Column("vm_name", sa.String(length=63), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("offering", sa.String(length=63), nullable=False),
        sa.Column("template", sa.String(length=63), nullable=False),
        sa.Column("vcpus", sa.Integer(), nullable=False),
        sa.Column("memory_mib", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("checkpoint", sa.String(length=63), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("size_mib", sa.Integer(), nullable=False),
        sa.Column("disk_file", sa.String(length=128), nullable=False),
        sa.Column("file", sa.String(length=128), nullable=False),
        sa.Column("charged_mib", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("written", sa.BigInteger(), nullable=True),
        sa.Column("sha256", sa.String(length=64), nullable=True),
        sa.Column("checkpoint_xml", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["store_id"], ["backup_stores.id"]),
        sa.ForeignKeyConstraint(["vm_id"], ["vms.id"], ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.ForeignKeyConstraint(["parent_id"], ["backups.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_backups_store_id", "backups", ["store_id"])
    op.create_index("ix_backups_vm_id", "backups", ["vm_id"])
    op.create_index("ix_backups_project_id", "backups", ["project_id"])
    op.create_table(
        "backup_schedules",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("vm_id", sa.Integer(), nullable=True),
        sa.Column("project_id", sa.Integer(), nullable=True),
        sa.Column("cron", sa.String(length=100), nullable=False),
        sa.Column("store_id", sa.Integer(), nullable=False),
        sa.Column("keep_last", sa.Integer(), nullable=True),
        sa.Column("keep_daily", sa.Integer(), nullable=True),
        sa.Column("next_run_at", sa.DateTime(), nullable=False),
        sa.Column("last_run_at", sa.DateTime(), nullable=True),
        sa.Column("last_result", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["vm_id"], ["vms.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.ForeignKeyConstraint(["store_id"], ["backup_stores.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("vm_id"),
        sa.UniqueConstraint("project_id"),
    )
    op.create_index("ix_backup_schedules_next_run_at", "backup_schedules", ["next_run_at"])
    with op.batch_alter_table("projects") as batch_op:
        batch_op.add_column(
            sa.Column("quota_backup_mib", sa.Integer(), nullable=False, server_default=str(1024 * 1024))
        )
        batch_op.add_column(sa.Column("used_backup_mib", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("projects") as batch_op:
        batch_op.drop_column("used_backup_mib")
        batch_op.drop_column("quota_backup_mib")
    op.drop_table("backup_schedules")
    op.drop_table("backups")
    op.drop_table("backup_stores")
