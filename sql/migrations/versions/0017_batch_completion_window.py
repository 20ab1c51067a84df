"""inference_jobs.expires_at: a Batch API batch's completion window ends (OpenAI's ``completion_window``, 24 h
after it was created); inference_jobs.status gains ``expired`` (a batch not ended by then: its finished lines are
kept, the others answered ``batch_expired``)

Batches that had not ended before this revision never had a deadline: they get a whole window from the upgrade
(24 h after it), so none expires at the moment of the upgrade.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07 04:10:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None

_STATUS_BEFORE = "queued | admitted | running | paused | done | failed | cancelled"
_STATUS_AFTER = "queued | admitted | running | paused | done | failed | cancelled | expired"
_WINDOW_S = 24 * 3600


def _status_comment(new: str, old: str) -> None:
    if op.get_bind().dialect.supports_comments:
        op.alter_column("inference_jobs", "status", existing_type=sa.String(length=20), existing_nullable=False,
                        comment=new, existing_comment=old)


def upgrade() -> None:
    with op.batch_alter_table("inference_jobs") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True, comment=(
            "a Batch API batch: the end of its completion window; one that has not ended by then expires (its "
            "unserved lines answered batch_expired); NULL: no deadline")))
    _status_comment(_STATUS_AFTER, _STATUS_BEFORE)
    _date_unfinished_batches()


def _date_unfinished_batches() -> None:
    """Batch API batches that have not ended: a completion window from now (they were stored without one)."""
    import datetime as dt
    import json

    jobs = sa.table("inference_jobs", sa.column("id", sa.Integer), sa.column("kind", sa.String),
                    sa.column("status", sa.String), sa.column("config", sa.JSON),
                    sa.column("expires_at", sa.DateTime(timezone=True)))
    conn = op.get_bind()
    deadline = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=_WINDOW_S)
    rows = conn.execute(sa.select(jobs.c.id, jobs.c.config).where(
        jobs.c.kind == "batch", jobs.c.status.in_(("queued", "admitted", "running", "paused")))).all()
    for job_id, config in rows:
        config = json.loads(config) if isinstance(config, str) else (config or {})
        if "openai_batch" in config:
            conn.execute(sa.update(jobs).where(jobs.c.id == job_id).values(expires_at=deadline))


def data_lost_by_downgrade(conn) -> list[str]:
    """What :func:`downgrade` would destroy in the store on ``conn`` (read by ``flexpipe_dag.sql.schema``)."""
    from flexpipe_dag.sql.schema import row_count

    lost = []
    waiting = row_count(conn, "inference_jobs",
                        "expires_at IS NOT NULL AND status IN ('queued', 'admitted', 'running', 'paused')")
    if waiting:
        lost.append(f"inference_jobs.expires_at of {waiting} batches not ended (they would wait without a deadline)")
    expired = row_count(conn, "inference_jobs", "status = 'expired'")
    if expired:
        lost.append(f"inference_jobs.status 'expired' of {expired} batches (they become 'failed', their error saying "
                    "they expired: 0016 knows no 'expired')")
    return lost


def downgrade() -> None:
    jobs = sa.table("inference_jobs", sa.column("status", sa.String), sa.column("error", sa.Text))
    op.get_bind().execute(sa.update(jobs).where(jobs.c.status == "expired").values(
        status="failed", error=sa.func.coalesce(jobs.c.error, "expired: its completion window passed before every "
                                                             "line was served (shown as failed by revision 0016)")))
    _status_comment(_STATUS_BEFORE, _STATUS_AFTER)
    with op.batch_alter_table("inference_jobs") as batch:
        batch.drop_column("expires_at")
