"""guest CPU models (issue 33): a cluster's CPU model (by default the baseline of its hosts) and an offering's

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07 10:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

# (table, column, type): every one nullable; None means "not set" (a cluster: its baseline; an offering: the
# cluster's model; a host: never asked; a VM: not started since)
COLUMNS = (
    ("clusters", "cpu_model", sa.String(length=64)),
    ("clusters", "cpu_baseline", sa.String(length=64)),
    ("clusters", "cpu_baseline_why", sa.Text()),
    ("hosts", "cpu_model", sa.String(length=64)),
    ("hosts", "cpu_models", sa.Text()),
    ("hosts", "cpu_xml", sa.Text()),
    ("offerings", "cpu_model", sa.String(length=64)),
    ("vms", "cpu_model", sa.String(length=64)),
)


def upgrade() -> None:
    for table in dict.fromkeys(t for t, _, _ in COLUMNS):
        with op.batch_alter_table(table) as batch_op:
            for _, column, kind in (c for c in COLUMNS if c[0] == table):
                batch_op.add_column(sa.Column(column, kind, nullable=True))


def downgrade() -> None:
    for table in dict.fromkeys(t for t, _, _ in COLUMNS):
        with op.batch_alter_table(table) as batch_op:
            for _, column, _ in (c for c in COLUMNS if c[0] == table):
                batch_op.drop_column(column)
