"""shift_events.decision_key (unique) and expires_at; pipeline_runs (which sample-writing runs are live)

One decision, one event row: the decision's deterministic key is unique. A requested shift carries the
deadline by which a live serving run must take it. ``pipeline_runs`` records the serving runs and batch
jobs that write metric samples, with their start, last heartbeat and end, so the controller never shifts on
a run that is not live, and whether a serving run decides its own shifts (the sensor then leaves it alone).
The status comment gains ``applying`` and ``expired`` (written out here, as 0006
does, so this revision stays what it is when the enum changes later).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 04:00:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

_STATUS_BEFORE = "decided | declined | requested | done | rolled_back | failed"
_STATUS_AFTER = "decided | declined | requested | done | rolled_back | failed | applying | expired"


def _status_comment(after: bool) -> None:
    if not op.get_bind().dialect.supports_comments:
        return
    op.alter_column("shift_events", "status", existing_type=sa.String(length=20), existing_nullable=False,
                    comment=_STATUS_AFTER if after else _STATUS_BEFORE,
                    existing_comment=_STATUS_BEFORE if after else _STATUS_AFTER)


def upgrade() -> None:
    with op.batch_alter_table("shift_events") as batch:
        batch.add_column(sa.Column(
            "decision_key", sa.String(length=200), nullable=True,
            comment="the decision's deterministic key (a shift's gear_shift run key): one decision, one row, "
                    "whatever the retries; NULL: an event without one"))
        batch.add_column(sa.Column(
            "expires_at", sa.DateTime(timezone=True), nullable=True,
            comment="a requested shift that no live serving run took by then expires; NULL: no deadline"))
        batch.create_unique_constraint("uq_shift_events_decision_key", ["decision_key"])
    _status_comment(after=True)
    op.create_table(
        "pipeline_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_key", sa.String(length=200), nullable=False, comment="metric_samples.run_key of its samples"),
        sa.Column("kind", sa.String(length=20), nullable=False, comment="serve | batch"),
        sa.Column("gear_key", sa.String(length=200), nullable=True, comment="the gear serving at the last heartbeat"),
        sa.Column("inline_control", sa.Boolean(), nullable=False, server_default=sa.false(),
                  comment="the run decides its own shifts (serve loop with inline control): the gear_shift_sensor "
                          "leaves it alone"),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True, comment="NULL while the run is live"),
        sa.PrimaryKeyConstraint("id", name="pk_pipeline_runs"),
        sa.UniqueConstraint("run_key", name="uq_pipeline_runs_run_key"),
    )


def data_lost_by_downgrade(conn) -> list[str]:
    """What :func:`downgrade` would destroy in the store on ``conn`` (read by ``flexpipe_dag.sql.schema``)."""
    from flexpipe_dag.sql.schema import row_count

    lost = []
    keyed = row_count(conn, "shift_events", "decision_key IS NOT NULL OR expires_at IS NOT NULL")
    if keyed:
        lost.append(f"shift_events.decision_key / expires_at of {keyed} events")
    newer = row_count(conn, "shift_events", "status IN ('applying', 'expired')")
    if newer:
        lost.append(f"{newer} shift events in status applying or expired, which the older code does not know")
    runs = row_count(conn, "pipeline_runs")
    if runs:
        lost.append(f"pipeline_runs, the liveness of {runs} sample-writing runs")
    return lost


def downgrade() -> None:
    op.drop_table("pipeline_runs")
    _status_comment(after=False)
    with op.batch_alter_table("shift_events") as batch:
        batch.drop_constraint("uq_shift_events_decision_key", type_="unique")
        batch.drop_column("expires_at")
        batch.drop_column("decision_key")
