"""backup disks (issue 32): a backup holds every disk of its VM (root and data volumes), one file each; its progress

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07 07:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "backup_disks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("backup_id", sa.Integer(), nullable=False),
        sa.Column("device", sa.String(length=16), nullable=False),
        sa.Column("volume", sa.String(length=63), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("pool", sa.String(length=63), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("size_mib", sa.Integer(), nullable=False),
        sa.Column("disk_file", sa.String(length=128), nullable=False),
        sa.Column("file", sa.String(length=128), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("sha256", sa.String(length=64), nullable=True),
        sa.Column("whole_file", sa.String(length=128), nullable=True),
        sa.Column("whole_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["backup_id"], ["backups.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_backup_disks_backup_id", "backup_disks", ["backup_id"])
    op.execute(
        "INSERT INTO backup_disks (backup_id, device, volume, role, pool, mode, size_mib, disk_file, file, bytes, "
        "sha256) SELECT id, 'vda', vm_name || '-root', 'root', '', kind, size_mib, disk_file, file, bytes, sha256 "
        "FROM backups"
    )
    with op.batch_alter_table("backups") as batch:
        batch.add_column(sa.Column("progress", sa.Integer(), nullable=False, server_default="0"))
        batch.drop_column("disk_file")
        batch.drop_column("file")
        batch.drop_column("sha256")


def downgrade() -> None:
    with op.batch_alter_table("backups") as batch:
        batch.add_column(sa.Column("disk_file", sa.String(length=128), nullable=False, server_default=""))
        batch.add_column(sa.Column("file", sa.String(length=128), nullable=False, server_default=""))
        batch.add_column(sa.Column("sha256", sa.String(length=64), nullable=True))
        batch.drop_column("progress")
    op.drop_index("ix_backup_disks_backup_id", table_name="backup_disks")
    op.drop_table("backup_disks")
