"""inference_jobs.owner_run_key: the serving run that serves a Batch API batch

Several ``flexpipe serve`` processes may share one store. Each used to serve every batch in it (each line
still written once, the compute spent twice); a batch is now claimed by one server, and taken over by
another once that server's run has ended or fallen silent. Rows stored before hold NULL: the next server
to look claims them.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 08:00:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("inference_jobs") as batch:
        batch.add_column(sa.Column("owner_run_key", sa.String(200), nullable=True,
                                   comment="the serving run that serves this Batch API batch (NULL: not claimed "
                                           "yet); another server takes it over once that run has ended or fallen "
                                           "silent"))


def data_lost_by_downgrade(conn) -> list[str]:
    """What :func:`downgrade` would destroy in the store on ``conn`` (read by ``flexpipe_dag.sql.schema``)."""
    from flexpipe_dag.sql.schema import row_count

    n = row_count(conn, "inference_jobs", "owner_run_key IS NOT NULL")
    return [f"inference_jobs.owner_run_key, the serving run of {n} Batch API batches (every server would serve "
            "them again)"] if n else []


def downgrade() -> None:
    with op.batch_alter_table("inference_jobs") as batch:
        batch.drop_column("owner_run_key")
