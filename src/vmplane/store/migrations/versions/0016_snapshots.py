"""disk snapshots (issue 32): snapshots, their files, and every volume's qcow2 chain

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07 04:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "snapshots",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("vm_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("quiesced", sa.Boolean(), nullable=False),
        sa.Column("live", sa.Boolean(), nullable=False),
        sa.Column("pause_ms", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("step_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["vm_id"], ["vms.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("vm_id", "name"),
    )
    op.create_index("ix_snapshots_vm_id", "snapshots", ["vm_id"])
    op.create_table(
        "snapshot_files",
        sa.Column("snapshot_id", sa.Integer(), nullable=False),
        sa.Column("volume_id", sa.Integer(), nullable=False),
        sa.Column("base", sa.String(length=128), nullable=False),
        sa.Column("overlay", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(["snapshot_id"], ["snapshots.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["volume_id"], ["volumes.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("snapshot_id", "volume_id"),
    )
    op.create_table(
        "volume_files",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("volume_id", sa.Integer(), nullable=False),
        sa.Column("file", sa.String(length=128), nullable=False),
        sa.Column("parent", sa.String(length=128), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.ForeignKeyConstraint(["volume_id"], ["volumes.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("volume_id", "file"),
    )
    op.create_index("ix_volume_files_volume_id", "volume_files", ["volume_id"])


def downgrade() -> None:
    op.drop_table("volume_files")
    op.drop_table("snapshot_files")
    op.drop_table("snapshots")
