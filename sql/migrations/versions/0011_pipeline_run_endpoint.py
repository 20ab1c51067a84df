"""pipeline_runs.endpoint: where clients reach a serving run (a front door's base URL), so the CLI and
Dagster find a live server in the store

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01 19:00:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pipeline_runs") as batch:
        batch.add_column(sa.Column("endpoint", sa.String(length=300), nullable=True,
                                   comment="base URL clients reach the run at (a front door's .../v1); "
                                           "NULL: a run without an API"))


def data_lost_by_downgrade(conn) -> list[str]:
    """What :func:`downgrade` would destroy in the store on ``conn`` (read by ``flexpipe_dag.sql.schema``)."""
    from flexpipe_dag.sql.schema import row_count

    n = row_count(conn, "pipeline_runs", "endpoint IS NOT NULL")
    return [f"pipeline_runs.endpoint of {n} serving runs"] if n else []


def downgrade() -> None:
    with op.batch_alter_table("pipeline_runs") as batch:
        batch.drop_column("endpoint")
