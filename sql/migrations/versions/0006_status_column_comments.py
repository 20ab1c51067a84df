"""status columns: comments list every value the code writes (flexpipe_dag.core.status enums)

Only the column comments change (PostgreSQL keeps them; SQLite has none, so this is a no-op there).
The values are written out here, not read from the enums, so the revision stays what it was when a
later revision changes an enum.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 10:00:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

#: (table, column, type length, comment before, comment after)
_COMMENTS = (
    ("health_tags", "failure", 40, "oom | timeout | crashed_stage | health_check",
     "oom | timeout | crashed_stage | health_check | refused | wrong_output"),
    ("metric_samples", "source", 10, None, "sim | live"),
    ("shift_events", "action", 20, "shift | hold | rollback", "shift | hold"),
    ("shift_events", "status", 20, "decided | running | done | rolled_back | failed | declined",
     "decided | declined | requested | done | rolled_back | failed"),
    ("inference_jobs", "status", 20, "queued | running | paused | done | failed",
     "queued | admitted | running | paused | done | failed"),
)


def _set_comments(after: bool) -> None:
    if not op.get_bind().dialect.supports_comments:
        return
    for table, column, length, before, new in _COMMENTS:
        op.alter_column(table, column, existing_type=sa.String(length=length), existing_nullable=False,
                        comment=new if after else before, existing_comment=before if after else new)


def upgrade() -> None:
    _set_comments(after=True)


def downgrade() -> None:
    _set_comments(after=False)
