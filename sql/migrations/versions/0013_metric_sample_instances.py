"""metric_samples.instances: how many pipeline instances of the gear a sample's window sums

A server running several instances of a gear writes one merged sample per round of their windows
(the fleet's rates and counts); readers compare it with ``instances`` x the gear's envelope. Rows stored
before hold NULL, read as 1.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 04:00:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("metric_samples") as batch:
        batch.add_column(sa.Column("instances", sa.Integer(), nullable=True,
                                   comment="pipeline instances of the gear whose windows a pipeline row sums (rates "
                                           "and counts are theirs together); NULL: 1 (stage rows, rows stored "
                                           "before it existed)"))


def data_lost_by_downgrade(conn) -> list[str]:
    """What :func:`downgrade` would destroy in the store on ``conn`` (read by ``flexpipe_dag.sql.schema``)."""
    from flexpipe_dag.sql.schema import row_count

    n = row_count(conn, "metric_samples", "instances > 1")
    return [f"metric_samples.instances of {n} samples merged from several pipeline instances"] if n else []


def downgrade() -> None:
    with op.batch_alter_table("metric_samples") as batch:
        batch.drop_column("instances")
