"""inference_jobs.admissions: how often the tide sensor admitted a job (numbers its run keys; the sensor's cursor no
longer keeps one entry per job ever admitted)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 03:40:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("inference_jobs") as batch:
        batch.add_column(sa.Column("admissions", sa.Integer(), server_default="0", nullable=False,
                                   comment="times the tide sensor admitted the job (numbers its run keys)"))


def data_lost_by_downgrade(conn) -> list[str]:
    """What :func:`downgrade` would destroy in the store on ``conn`` (read by ``flexpipe_dag.sql.schema``)."""
    from flexpipe_dag.sql.schema import row_count

    admitted = row_count(conn, "inference_jobs", "admissions > 0")
    return [f"inference_jobs.admissions, the admission counts of {admitted} jobs (their next run keys would repeat "
            "used ones)"] if admitted else []


def downgrade() -> None:
    with op.batch_alter_table("inference_jobs") as batch:
        batch.drop_column("admissions")
