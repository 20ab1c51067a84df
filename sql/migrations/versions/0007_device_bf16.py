"""devices.bf16: whether a device runs bf16 (None: unknown), from the probe or the datasheet

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 22:30:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("devices") as batch:
        batch.add_column(sa.Column("bf16", sa.Boolean(), nullable=True,
                                   comment="runs bf16 (compute capability >= 8.0); NULL: unknown"))


def data_lost_by_downgrade(conn) -> list[str]:
    """What :func:`downgrade` would destroy in the store on ``conn`` (read by ``flexpipe_dag.sql.schema``)."""
    from flexpipe_dag.sql.schema import row_count

    known = row_count(conn, "devices", "bf16 IS NOT NULL")
    return [f"devices.bf16, the bf16 support measured for {known} devices"] if known else []


def downgrade() -> None:
    with op.batch_alter_table("devices") as batch:
        batch.drop_column("bf16")
