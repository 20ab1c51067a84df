"""api_files: files uploaded through the front door's Files API (Batch API input); inference_jobs.status
gains ``cancelled`` (a batch its client cancelled)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 11:20:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

_STATUS_BEFORE = "queued | admitted | running | paused | done | failed"
_STATUS_AFTER = "queued | admitted | running | paused | done | failed | cancelled"


def _status_comment(new: str, old: str) -> None:
    if op.get_bind().dialect.supports_comments:
        op.alter_column("inference_jobs", "status", existing_type=sa.String(length=20), existing_nullable=False,
                        comment=new, existing_comment=old)


def upgrade() -> None:
    op.create_table(
        "api_files",
        sa.Column("id", sa.String(length=64), primary_key=True),
        sa.Column("purpose", sa.String(length=20), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    _status_comment(_STATUS_AFTER, _STATUS_BEFORE)


def data_lost_by_downgrade(conn) -> list[str]:
    """What :func:`downgrade` would destroy in the store on ``conn`` (read by ``flexpipe_dag.sql.schema``)."""
    from flexpipe_dag.sql.schema import row_count

    files = row_count(conn, "api_files")
    cancelled = row_count(conn, "inference_jobs", "status = 'cancelled'")
    lost = [f"api_files, {files} uploaded files"] if files else []
    if cancelled:
        lost.append(f"inference_jobs.status 'cancelled' of {cancelled} jobs (left as a value 0009 does not know)")
    return lost


def downgrade() -> None:
    _status_comment(_STATUS_BEFORE, _STATUS_AFTER)
    op.drop_table("api_files")
