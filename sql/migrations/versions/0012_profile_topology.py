"""profile topology: hosts and network tiers, from which a profile's device pairs are derived

Two new tables: ``hosts`` (a profile version's hosts: rack, intra-host link figures) and
``network_tiers`` (its tiers between hosts: ``inter_node``, ``inter_rack``). A profile with a topology
stores rows linear in its devices; ``links`` then holds only pairs measured apart from it (overrides).
Profiles stored before keep their explicit links and no topology, and load as they did.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 07:30:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('hosts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('profile_version_id', sa.Integer(), nullable=False),
    sa.Column('host_key', sa.String(length=200), nullable=False),
    sa.Column('rack_key', sa.String(length=200), nullable=True, comment='rack of the host; NULL: the one default rack'),
    sa.Column('intra_kind', sa.String(length=40), nullable=False),
    sa.Column('intra_bandwidth_gbps', sa.Float(), nullable=False),
    sa.Column('intra_latency_us', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['profile_version_id'], ['profile_versions.id'], name=op.f('fk_hosts_profile_version_id_profile_versions'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_hosts')),
    sa.UniqueConstraint('profile_version_id', 'host_key', name=op.f('uq_hosts_profile_version_id_host_key'))
    )
    op.create_index(op.f('ix_hosts_profile_version_id'), 'hosts', ['profile_version_id'])
    op.create_table('network_tiers',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('profile_version_id', sa.Integer(), nullable=False),
    sa.Column('tier', sa.String(length=20), nullable=False, comment='inter_node (hosts of one rack) or inter_rack'),
    sa.Column('bandwidth_gbps', sa.Float(), nullable=False),
    sa.Column('latency_us', sa.Float(), nullable=False),
    sa.Column('oversubscription', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['profile_version_id'], ['profile_versions.id'], name=op.f('fk_network_tiers_profile_version_id_profile_versions'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_network_tiers')),
    sa.UniqueConstraint('profile_version_id', 'tier', name=op.f('uq_network_tiers_profile_version_id_tier'))
    )
    op.create_index(op.f('ix_network_tiers_profile_version_id'), 'network_tiers', ['profile_version_id'])


def data_lost_by_downgrade(conn) -> list[str]:
    """What :func:`downgrade` would destroy in the store on ``conn`` (read by ``flexpipe_dag.sql.schema``)."""
    from flexpipe_dag.sql.schema import row_count

    hosts = row_count(conn, "hosts")
    return [f"the topology of stored profiles ({hosts} hosts and their network tiers; their device pairs would "
            f"have no link)"] if hosts else []


def downgrade() -> None:
    op.drop_index(op.f('ix_network_tiers_profile_version_id'), table_name='network_tiers')
    op.drop_table('network_tiers')
    op.drop_index(op.f('ix_hosts_profile_version_id'), table_name='hosts')
    op.drop_table('hosts')
