"""Dagster resource that produces a cluster profile: measured, declared, or both merged."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from flexpipe_dag.core.cluster import ClusterProfile, load_cluster_profile
from flexpipe_dag.core.errors import InputError


class ProberResource(ConfigurableResource):
    """Where the cluster profile comes from.

    * ``probe=True, cluster_file=""``: measure this host's devices (GPUs, or CPU workers).
    * ``probe=False, cluster_file=F``: the declared inventory in ``F`` (any of the three YAML forms).
    * both: measure, then merge into the declared inventory (measured figures win).
    """

    probe: bool = True
    cluster_file: str = ""
    cluster_id: str = Field("", description="id of a probed cluster (default: the host name)")
    num_cpu_workers: int = Field(2, ge=1, le=64, description="CPU worker processes measured on a host without GPUs")

    def get_profile(self) -> ClusterProfile:
        """Build the profile. Raises InputError for a bad declared file or an empty configuration."""
        declared = load_cluster_profile(self.cluster_file) if self.cluster_file else None
        if not self.probe:
            if declared is None:
                raise InputError("prober resource", "cluster_file", "set a cluster file or enable probe")
            return declared
        from flexpipe_dag.resources.probe import ProbeSettings, merge_profiles, probe_host

        measured = probe_host(self.cluster_id or None, ProbeSettings(num_cpu_workers=self.num_cpu_workers))
        return merge_profiles(declared, measured) if declared else measured
