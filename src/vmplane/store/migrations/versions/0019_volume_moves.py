"""volume moves (issue 32): a volume's copy in flight to another pool, and the files a move left to delete

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07 07:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("volumes") as batch_op:
        batch_op.add_column(sa.Column("move_pool_id", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("move_file", sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column("move_kind", sa.String(length=8), nullable=True))
        batch_op.create_foreign_key("fk_volumes_move_pool_id", "pools", ["move_pool_id"], ["id"])
    op.create_table(
        "leftover_files",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("pool_id", sa.Integer(), nullable=False),
        sa.Column("file", sa.String(length=128), nullable=False),
        sa.Column("size_mib", sa.Integer(), nullable=False),
        sa.Column("volume", sa.String(length=63), nullable=False),
        sa.Column("why", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["pool_id"], ["pools.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("pool_id", "file"),
    )


def downgrade() -> None:
    op.drop_table("leftover_files")
    with op.batch_alter_table("volumes") as batch_op:
        batch_op.drop_constraint("fk_volumes_move_pool_id", type_="foreignkey")
        batch_op.drop_column("move_kind")
        batch_op.drop_column("move_file")
        batch_op.drop_column("move_pool_id")
