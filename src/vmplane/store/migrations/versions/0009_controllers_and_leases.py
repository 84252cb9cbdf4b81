"""several control-plane processes: each process's registration (its epoch is its fencing token), leases
on the work only one process may do (the coordinator's loops, each host's listener), and the owner of
each operation and migration

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 06:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "controllers",
        sa.Column("epoch", sa.Integer(), nullable=False, autoincrement=True),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("hostname", sa.String(length=128), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("api_url", sa.String(length=255), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("lease_s", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("renewed_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("epoch"),
    )
    op.create_index("ix_controllers_state", "controllers", ["state"])
    op.create_table(
        "leases",
        sa.Column("name", sa.String(length=80), nullable=False),
        sa.Column("holder", sa.Integer(), nullable=True),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("acquired_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    for table in ("operations", "migrations"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("owner", sa.Integer(), nullable=True))
            batch_op.create_index(f"ix_{table}_owner", ["owner"])


def downgrade() -> None:
    for table in ("operations", "migrations"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(f"ix_{table}_owner")
            batch_op.drop_column("owner")
    op.drop_table("leases")
    op.drop_index("ix_controllers_state", table_name="controllers")
    op.drop_table("controllers")
