"""metric_samples.created_at indexed: samples older than the retention are pruned by the time they were written

A server writes one pipeline row and one row per stage every 2 s (about 170,000 rows a day for 3 stages);
``flexpipe store prune`` and the ``store_retention`` schedule delete the rows written before the retention
window, in chunks, which the index finds without reading the table.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 20:30:00
"""
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_metric_samples_created_at", "metric_samples", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_metric_samples_created_at", table_name="metric_samples")
