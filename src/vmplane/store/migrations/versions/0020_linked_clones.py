"""linked clones (issue 32): a volume whose first file is an overlay on another volume's file (a snapshot's base)

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07 08:05:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("volumes") as batch_op:
        batch_op.add_column(sa.Column("base_file", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("volumes") as batch_op:
        batch_op.drop_column("base_file")
