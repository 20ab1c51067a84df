"""Cluster profiles in the store: versioned measurements of a cluster's devices and links."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import selectinload

from flexpipe_dag.core.cluster import ClusterProfile, Device, Link
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.session import StoreBase, get_or_insert, json_ready, next_number


@dataclass(frozen=True)
class ProfileVersionInfo:
    """Identity of a stored profile version."""

    id: int
    cluster_key: str
    version: int
    source: str
    measured_at: dt.datetime


class Profiles(StoreBase):
    """Cluster profiles, one version per measurement, never updated (tables ``clusters``,
    ``profile_versions``, ``devices``, ``links``).

    Raises:
        KeyError: :meth:`load_profile` of a profile version that is not stored.
    """

    def save_profile(self, profile: ClusterProfile) -> ProfileVersionInfo:
        """Store ``profile`` as the next version of its cluster (all rows in one transaction).

        Concurrent writers (threads or processes) each get their own version number.
        """
        with self.session() as s:
            cluster = get_or_insert(s, m.Cluster, cluster_key=profile.cluster_id)
            version = next_number(s, m.ProfileVersion.version, cluster, m.ProfileVersion.cluster_id == cluster.id)
            pv = m.ProfileVersion(cluster_id=cluster.id, version=version, source=profile.source,
                                  measured_at=profile.measured_at, notes=list(profile.notes))
            pv.devices = [
                m.DeviceRow(device_key=d.device_id, node_key=d.node_id, model_name=d.model_name,
                            generation=d.generation, kind=d.kind, memory_gib=d.memory_gib,
                            peak_tflops=d.peak_tflops, hbm_bandwidth_gbps=d.hbm_bandwidth_gbps,
                            compute_score=d.compute_score, max_micro_batch=d.max_micro_batch,
                            available_until=d.available_until, bf16=d.bf16, op_timings_ms=dict(d.op_timings_ms),
                            facts=json_ready(d.facts))
                for d in profile.devices
            ]
            pv.links = [
                m.LinkRow(src_device_key=link.src_device_id, dst_device_key=link.dst_device_id,
                          bandwidth_gbps=link.bandwidth_gbps, latency_us=link.latency_us, kind=link.kind)
                for link in profile.links
            ]
            s.add(pv)
            s.flush()
            return ProfileVersionInfo(pv.id, cluster.cluster_key, pv.version, pv.source, pv.measured_at)

    def list_profile_versions(self, cluster_key: str | None = None) -> list[ProfileVersionInfo]:
        """All stored profile versions, oldest first (optionally of one cluster)."""
        with self.session() as s:
            q = select(m.ProfileVersion, m.Cluster.cluster_key).join(m.Cluster).order_by(m.ProfileVersion.id)
            if cluster_key is not None:
                q = q.where(m.Cluster.cluster_key == cluster_key)
            return [ProfileVersionInfo(pv.id, key, pv.version, pv.source, pv.measured_at) for pv, key in s.execute(q)]

    def load_profile(self, profile_version_id: int) -> ClusterProfile:
        """Rebuild the :class:`ClusterProfile` of one stored version; ``KeyError`` if absent."""
        with self.session() as s:
            pv = s.get(m.ProfileVersion, profile_version_id,
                       options=[selectinload(m.ProfileVersion.devices), selectinload(m.ProfileVersion.links),
                                selectinload(m.ProfileVersion.cluster)])
            if pv is None:
                raise KeyError(profile_version_id)
            return ClusterProfile(
                cluster_id=pv.cluster.cluster_key, source=pv.source, measured_at=pv.measured_at,
                notes=list(pv.notes),
                devices=[Device(device_id=d.device_key, node_id=d.node_key, model_name=d.model_name,
                                generation=d.generation, kind=d.kind, memory_gib=d.memory_gib,
                                peak_tflops=d.peak_tflops, hbm_bandwidth_gbps=d.hbm_bandwidth_gbps,
                                compute_score=d.compute_score, max_micro_batch=d.max_micro_batch,
                                available_until=d.available_until, bf16=d.bf16, op_timings_ms=d.op_timings_ms,
                                facts=d.facts)
                         for d in pv.devices],
                links=[Link(src_device_id=link.src_device_key, dst_device_id=link.dst_device_key,
                            bandwidth_gbps=link.bandwidth_gbps, latency_us=link.latency_us, kind=link.kind)
                       for link in pv.links],
            )

    def latest_profile(self, cluster_key: str | None = None) -> tuple[ProfileVersionInfo, ClusterProfile] | None:
        """The newest profile version (of ``cluster_key``, or of any cluster) or ``None``."""
        versions = self.list_profile_versions(cluster_key)
        if not versions:
            return None
        info = versions[-1]
        return info, self.load_profile(info.id)
