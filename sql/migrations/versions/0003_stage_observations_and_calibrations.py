"""stage observations and calibrations

Two new tables: ``stage_observations`` (per-step evidence the runtime records for calibration) and
``calibrations`` (a calibration version beside the profile version it refines; the profile's own rows
are never changed).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 10:17:09.781153
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('stage_observations',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_key', sa.String(length=200), nullable=False),
    sa.Column('gear_key', sa.String(length=200), nullable=False),
    sa.Column('cluster_key', sa.String(length=200), nullable=True),
    sa.Column('stage_index', sa.Integer(), nullable=False),
    sa.Column('device_key', sa.String(length=200), nullable=False),
    sa.Column('dst_device_key', sa.String(length=200), nullable=True),
    sa.Column('is_first', sa.Boolean(), nullable=False),
    sa.Column('is_last', sa.Boolean(), nullable=False),
    sa.Column('layer_start', sa.Integer(), nullable=False),
    sa.Column('layer_end', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=10), nullable=False, comment='prefill | decode | mixed'),
    sa.Column('num_seqs', sa.Integer(), nullable=False),
    sa.Column('prefill_seqs', sa.Integer(), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('decode_tokens', sa.Integer(), nullable=False),
    sa.Column('kv_context_tokens', sa.Integer(), nullable=False),
    sa.Column('attended_pairs', sa.BigInteger(), nullable=False),
    sa.Column('wall_ms', sa.Float(), nullable=False),
    sa.Column('send_ms', sa.Float(), nullable=True, comment='sender-side hand-off to the next stage'),
    sa.Column('send_bytes', sa.BigInteger(), nullable=False),
    sa.Column('mb_id', sa.BigInteger(), nullable=False),
    sa.Column('t_s', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_stage_observations'))
    )
    op.create_index(op.f('ix_stage_observations_device_key'), 'stage_observations', ['device_key'])
    op.create_index(op.f('ix_stage_observations_gear_key'), 'stage_observations', ['gear_key'])
    op.create_index('ix_stage_observations_run_key_t_s', 'stage_observations', ['run_key', 't_s'])

    op.create_table('calibrations',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('profile_version_id', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('model_name', sa.String(length=200), nullable=False),
    sa.Column('dtype', sa.String(length=20), nullable=False),
    sa.Column('num_observations', sa.Integer(), nullable=False),
    sa.Column('run_keys', sa.JSON(), nullable=False),
    sa.Column('changed_devices', sa.JSON(), nullable=False),
    sa.Column('summary', sa.JSON(), nullable=False),
    sa.Column('document', sa.JSON(), nullable=False, comment='flexpipe_dag.calibration.Calibration.to_dict()'),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['profile_version_id'], ['profile_versions.id'], name=op.f('fk_calibrations_profile_version_id_profile_versions'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_calibrations')),
    sa.UniqueConstraint('profile_version_id', 'version', name=op.f('uq_calibrations_profile_version_id_version'))
    )
    op.create_index(op.f('ix_calibrations_profile_version_id'), 'calibrations', ['profile_version_id'])



def data_lost_by_downgrade(conn) -> list[str]:
    """What :func:`downgrade` would destroy in the store on ``conn`` (read by ``flexpipe_dag.sql.schema``)."""
    from flexpipe_dag.sql.schema import row_count

    counts = {name: row_count(conn, name) for name in ("stage_observations", "calibrations")}
    return [f"table {name} ({rows} rows)" for name, rows in counts.items() if rows]


def downgrade() -> None:
    op.drop_index(op.f('ix_calibrations_profile_version_id'), table_name='calibrations')
    op.drop_table('calibrations')
    op.drop_index('ix_stage_observations_run_key_t_s', table_name='stage_observations')
    op.drop_index(op.f('ix_stage_observations_gear_key'), table_name='stage_observations')
    op.drop_index(op.f('ix_stage_observations_device_key'), table_name='stage_observations')
    op.drop_table('stage_observations')
