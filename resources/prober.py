"""Dagster resource that produces a cluster profile: measured, declared, or both merged."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from flexpipe_dag.core.cluster import ClusterProfile
from flexpipe_dag.profiling.source import build_profile


class ProberResource(ConfigurableResource):
    """Where the cluster profile comes from.

    * ``probe=True, cluster_file=""``: measure this host's devices (GPUs, or CPU workers).
    * ``probe=False, cluster_file=F``: the declared inventory in ``F`` (any of the three YAML forms).
    * both: measure, then merge into the declared inventory (measured figures win).
    """

    probe: bool = Field(default=True, description="measure this host's devices (GPUs, or CPU worker processes)")
    cluster_file: str = Field(default="", description="declared inventory (YAML / JSON); with probe, the measured "
                              "figures are merged into it; empty = the probe alone")
    cluster_id: str = Field(default="", description="id of a probed cluster (default: the host name)")
    num_cpu_workers: int = Field(default=2, ge=1, le=64,
                                 description="CPU worker processes measured on a host without GPUs")

    def get_profile(self) -> ClusterProfile:
        """Build the profile (:func:`flexpipe_dag.profiling.source.build_profile`).

        Raises:
            InputError: a bad declared file, or an empty configuration.
        """
        return build_profile(probe=self.probe, cluster_file=self.cluster_file, cluster_id=self.cluster_id,
                             num_cpu_workers=self.num_cpu_workers)
