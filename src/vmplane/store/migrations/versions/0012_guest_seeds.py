"""cloud-init seeds (issue 30): a VM's hostname, SSH keys and user data; a project's SSH keys

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 22:45:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("vms") as batch_op:
        batch_op.add_column(sa.Column("hostname", sa.String(length=253), nullable=True))
        batch_op.add_column(sa.Column("ssh_keys", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("user_data", sa.LargeBinary(), nullable=True))
    op.create_table(
        "project_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("project_id", "name"),
    )
    op.create_index("ix_project_keys_project_id", "project_keys", ["project_id"])


def downgrade() -> None:
    op.drop_index("ix_project_keys_project_id", table_name="project_keys")
    op.drop_table("project_keys")
    with op.batch_alter_table("vms") as batch_op:
        batch_op.drop_column("user_data")
        batch_op.drop_column("ssh_keys")
        batch_op.drop_column("hostname")
