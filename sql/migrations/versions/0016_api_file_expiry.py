"""api_files.expires_at: an uploaded file expires (OpenAI's ``expires_after``; a batch file, 30 days by default);
api_files.deleted_at: a deleted file's row stays a day as a list cursor (its content emptied); api_files indexed by
(created_at, id), the order GET /v1/files pages in; inference_jobs.results_expire_at: a Batch API batch's output
and error files expire (OpenAI's ``output_expires_after``, 30 days after it ended by default), then its result rows
are pruned (batches that had already ended: 30 days after their last update);
inference_jobs indexed by (kind, status) and (kind, id): a server's batch runner polls the unfinished batches every
half second and ``GET /v1/batches`` pages them newest first

An expired file is no longer listed or served; ``flexpipe store prune`` and the ``store_retention`` schedule delete
it unless a batch that has not ended still reads it. Files uploaded before this revision keep NULL: kept until
deleted (``DELETE /v1/files/{id}``).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07 00:20:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    comment = "when the file is no longer served and may be pruned; NULL: kept until deleted"
    with op.batch_alter_table("api_files") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True, comment=comment))
        batch.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True, comment=(
            "when DELETE /v1/files took it (its content is gone; the row stays a while as a list cursor); NULL: not "
            "deleted")))
    op.create_index("ix_api_files_expires_at", "api_files", ["expires_at"])
    op.create_index("ix_api_files_created_at_id", "api_files", ["created_at", "id"])
    op.create_index("ix_inference_jobs_kind_status", "inference_jobs", ["kind", "status"])
    with op.batch_alter_table("inference_jobs") as batch:
        batch.add_column(sa.Column("results_expire_at", sa.DateTime(timezone=True), nullable=True, comment=(
            "a Batch API batch that has ended: when its output and error files expire and a prune deletes its result "
            "rows (their counts kept); NULL: not ended, or not such a batch")))
    op.create_index("ix_inference_jobs_results_expire_at", "inference_jobs", ["results_expire_at"])
    _date_ended_batches()
    op.create_index("ix_inference_jobs_kind_id", "inference_jobs", ["kind", "id"])


def _date_ended_batches() -> None:
    """Batch API batches that ended before this revision: their output files expire 30 days (OpenAI's default) after
    they ended (their last update), so their result rows are pruned as a new batch's are."""
    import datetime as dt
    import json

    jobs = sa.table("inference_jobs", sa.column("id", sa.Integer), sa.column("kind", sa.String),
                    sa.column("status", sa.String), sa.column("config", sa.JSON),
                    sa.column("updated_at", sa.DateTime(timezone=True)),
                    sa.column("results_expire_at", sa.DateTime(timezone=True)))
    conn = op.get_bind()
    rows = conn.execute(sa.select(jobs.c.id, jobs.c.config, jobs.c.updated_at).where(
        jobs.c.kind == "batch", jobs.c.status.in_(("done", "cancelled", "failed")))).all()
    for job_id, config, updated_at in rows:
        config = json.loads(config) if isinstance(config, str) else (config or {})
        if "openai_batch" not in config or updated_at is None:
            continue
        ended = updated_at if updated_at.tzinfo is not None else updated_at.replace(tzinfo=dt.UTC)
        conn.execute(sa.update(jobs).where(jobs.c.id == job_id)
                     .values(results_expire_at=ended + dt.timedelta(days=30)))


def data_lost_by_downgrade(conn) -> list[str]:
    """What :func:`downgrade` would destroy in the store on ``conn`` (read by ``flexpipe_dag.sql.schema``)."""
    from flexpipe_dag.sql.schema import row_count

    dated = row_count(conn, "api_files", "expires_at IS NOT NULL AND deleted_at IS NULL")
    gone = row_count(conn, "api_files", "deleted_at IS NOT NULL")
    lost = [f"api_files.expires_at of {dated} uploaded files (they would be kept until deleted)"] if dated else []
    if gone:
        lost.append(f"api_files.deleted_at of {gone} deleted files (they would be listed again, empty)")
    ending = row_count(conn, "inference_jobs", "results_expire_at IS NOT NULL")
    if ending:
        lost.append(f"inference_jobs.results_expire_at of {ending} ended batches (their results would be kept)")
    return lost


def downgrade() -> None:
    op.drop_index("ix_inference_jobs_results_expire_at", table_name="inference_jobs")
    with op.batch_alter_table("inference_jobs") as batch:
        batch.drop_column("results_expire_at")
    op.drop_index("ix_inference_jobs_kind_id", table_name="inference_jobs")
    op.drop_index("ix_inference_jobs_kind_status", table_name="inference_jobs")
    op.drop_index("ix_api_files_created_at_id", table_name="api_files")
    op.drop_index("ix_api_files_expires_at", table_name="api_files")
    with op.batch_alter_table("api_files") as batch:
        batch.drop_column("deleted_at")
        batch.drop_column("expires_at")
