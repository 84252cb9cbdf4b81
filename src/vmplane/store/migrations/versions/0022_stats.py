"""usage graphs (issue 33): points of every VM, host and project, per tier and bucket (1 min, 10 min)

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07 10:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

VALUES = (
    "cpu_pct",
    "cpu_cores",
    "mem_used_mib",
    "mem_total_mib",
    "disk_rd_bps",
    "disk_wr_bps",
    "net_rx_bps",
    "net_tx_bps",
)


def upgrade() -> None:
    op.create_table(
        "stat_samples",
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("obj_id", sa.Integer(), nullable=False),
        sa.Column("tier", sa.String(length=4), nullable=False),
        sa.Column("bucket", sa.BigInteger(), nullable=False),
        *(sa.Column(name, sa.Float(), nullable=True) for name in VALUES),
        sa.PrimaryKeyConstraint("kind", "obj_id", "tier", "bucket"),
    )
    op.create_index("ix_stat_samples_tier_bucket", "stat_samples", ["tier", "bucket"])


def downgrade() -> None:
    op.drop_index("ix_stat_samples_tier_bucket", table_name="stat_samples")
    op.drop_table("stat_samples")
