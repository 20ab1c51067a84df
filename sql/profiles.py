"""Cluster profiles in the store: versioned measurements of a cluster's devices and links."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Row, Table, insert, select
from sqlalchemy.orm import Session, selectinload

from flexpipe_dag.core.cluster import ClusterProfile, Device, Link
from flexpipe_dag.core.topology import Host, NetworkTier, Topology
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


def _device_row(profile_version_id: int, d: Device) -> dict[str, Any]:
    return {"profile_version_id": profile_version_id, "device_key": d.device_id, "node_key": d.node_id,
            "model_name": d.model_name, "generation": d.generation, "kind": d.kind, "memory_gib": d.memory_gib,
            "peak_tflops": d.peak_tflops, "hbm_bandwidth_gbps": d.hbm_bandwidth_gbps,
            "compute_score": d.compute_score, "max_micro_batch": d.max_micro_batch,
            "available_until": d.available_until, "bf16": d.bf16, "op_timings_ms": dict(d.op_timings_ms),
            "facts": json_ready(d.facts)}


def _topology_rows(profile_version_id: int, topology: Topology) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(host rows, tier rows)`` of one topology."""
    hosts = [{"profile_version_id": profile_version_id, "host_key": h.host_id, "rack_key": h.rack_id,
              "intra_kind": h.intra_kind, "intra_bandwidth_gbps": h.intra_bandwidth_gbps,
              "intra_latency_us": h.intra_latency_us} for h in topology.hosts]
    tiers = [{"profile_version_id": profile_version_id, "tier": name, "bandwidth_gbps": t.bandwidth_gbps,
              "latency_us": t.latency_us, "oversubscription": t.oversubscription}
             for name, t in (("inter_node", topology.inter_node), ("inter_rack", topology.inter_rack)) if t is not None]
    return hosts, tiers


def _table(row_type: type[m.Base]) -> Table:
    """The Core table of a model (inserts and selects of plain rows: no ORM object per row)."""
    return cast(Table, row_type.__table__)


def _rows(s: Session, row_type: type[m.Base], profile_version_id: int) -> list[Row[Any]]:
    """The rows of one table that belong to a profile version, in insertion order (plain rows, no ORM objects)."""
    table = _table(row_type)
    return list(s.execute(select(table).where(table.c.profile_version_id == profile_version_id).order_by(table.c.id)))


def _topology(hosts: list[Row[Any]], tiers: list[Row[Any]]) -> Topology | None:
    """The stored topology of a profile version (``None``: a profile of explicit links only).

    Raises:
        KeyError: hosts stored without their ``inter_node`` tier.
    """
    if not hosts:
        return None
    by_name = {t.tier: NetworkTier(bandwidth_gbps=t.bandwidth_gbps, latency_us=t.latency_us,
                                   oversubscription=t.oversubscription) for t in tiers}
    return Topology(hosts=[Host(host_id=h.host_key, rack_id=h.rack_key, intra_kind=h.intra_kind,
                                intra_bandwidth_gbps=h.intra_bandwidth_gbps, intra_latency_us=h.intra_latency_us)
                           for h in hosts],
                    inter_node=by_name["inter_node"], inter_rack=by_name.get("inter_rack"))


class Profiles(StoreBase):
    """Cluster profiles, one version per measurement, never updated (tables ``clusters``,
    ``profile_versions``, ``devices``, ``links``, ``hosts``, ``network_tiers``).

    Rows grow linearly with devices: a profile with a topology stores its hosts and tiers, and
    ``links`` holds only its explicit pairs (overrides), never every pair.

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
            s.add(pv)
            s.flush()  # the version's id, for the rows below; all of them commit together or not at all
            # Core inserts (executemany), not ORM objects: 10,000 devices in well under a second
            s.execute(insert(_table(m.DeviceRow)), [_device_row(pv.id, d) for d in profile.devices])
            if profile.links:
                s.execute(insert(_table(m.LinkRow)), [
                    {"profile_version_id": pv.id, "src_device_key": link.src_device_id,
                     "dst_device_key": link.dst_device_id, "bandwidth_gbps": link.bandwidth_gbps,
                     "latency_us": link.latency_us, "kind": link.kind} for link in profile.links])
            if profile.topology is not None:
                hosts, tiers = _topology_rows(pv.id, profile.topology)
                s.execute(insert(_table(m.HostRow)), hosts)
                s.execute(insert(_table(m.NetworkTierRow)), tiers)
            return ProfileVersionInfo(pv.id, cluster.cluster_key, pv.version, pv.source, pv.measured_at)

    def list_profile_versions(self, cluster_key: str | None = None) -> list[ProfileVersionInfo]:
        """All stored profile versions, oldest first (optionally of one cluster)."""
        with self.session() as s:
            q = select(m.ProfileVersion, m.Cluster.cluster_key).join(m.Cluster).order_by(m.ProfileVersion.id)
            if cluster_key is not None:
                q = q.where(m.Cluster.cluster_key == cluster_key)
            return [ProfileVersionInfo(pv.id, key, pv.version, pv.source, pv.measured_at) for pv, key in s.execute(q)]

    def load_profile(self, profile_version_id: int) -> ClusterProfile:
        """Rebuild the :class:`ClusterProfile` of one stored version (validated again); ``KeyError`` if absent."""
        with self.session() as s:
            pv = s.get(m.ProfileVersion, profile_version_id, options=[selectinload(m.ProfileVersion.cluster)])
            if pv is None:
                raise KeyError(profile_version_id)
            devices, links, hosts, tiers = (_rows(s, row_type, pv.id) for row_type in
                                            (m.DeviceRow, m.LinkRow, m.HostRow, m.NetworkTierRow))
            return ClusterProfile(
                cluster_id=pv.cluster.cluster_key, source=pv.source, measured_at=pv.measured_at,
                notes=list(pv.notes),
                devices=[Device(device_id=d.device_key, node_id=d.node_key, model_name=d.model_name,
                                generation=d.generation, kind=d.kind, memory_gib=d.memory_gib,
                                peak_tflops=d.peak_tflops, hbm_bandwidth_gbps=d.hbm_bandwidth_gbps,
                                compute_score=d.compute_score, max_micro_batch=d.max_micro_batch,
                                available_until=d.available_until, bf16=d.bf16, op_timings_ms=d.op_timings_ms,
                                facts=d.facts)
                         for d in devices],
                links=[Link(src_device_id=link.src_device_key, dst_device_id=link.dst_device_key,
                            bandwidth_gbps=link.bandwidth_gbps, latency_us=link.latency_us, kind=link.kind)
                       for link in links],
                topology=_topology(hosts, tiers),
            )

    def latest_profile(self, cluster_key: str | None = None) -> tuple[ProfileVersionInfo, ClusterProfile] | None:
        """The newest profile version (of ``cluster_key``, or of any cluster) or ``None``."""
        versions = self.list_profile_versions(cluster_key)
        if not versions:
            return None
        info = versions[-1]
        return info, self.load_profile(info.id)
