"""request rates named rps: gears.qps_min/qps_max -> rps_min/rps_max, metric_samples.qps -> rps

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 18:30:00
"""
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

_RENAMES = {"gears": (("qps_min", "rps_min"), ("qps_max", "rps_max")), "metric_samples": (("qps", "rps"),)}


def upgrade() -> None:
    for table, pairs in _RENAMES.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            for old, new in pairs:
                batch_op.alter_column(old, new_column_name=new)


def downgrade() -> None:
    for table, pairs in _RENAMES.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            for old, new in pairs:
                batch_op.alter_column(new, new_column_name=old)
