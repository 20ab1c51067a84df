"""Where a cluster profile comes from: measured on this host, declared in a file, or both merged."""

from __future__ import annotations

from flexpipe_dag.core.cluster import ClusterProfile, load_cluster_profile
from flexpipe_dag.core.errors import InputError


def build_profile(*, probe: bool, cluster_file: str = "", cluster_id: str = "",
                  num_cpu_workers: int = 2) -> ClusterProfile:
    """The cluster profile to store.

    * ``probe=True, cluster_file=""``: measure this host's devices (GPUs, or CPU worker processes).
    * ``probe=False, cluster_file=F``: the declared inventory in ``F`` (native, seed or fleet form).
    * both: measure, then merge into the declared inventory (measured figures win).

    Raises:
        InputError: a bad declared file, or neither a file nor a probe asked for.
    """
    declared = load_cluster_profile(cluster_file) if cluster_file else None
    if not probe:
        if declared is None:
            raise InputError("cluster profile", "cluster_file", "set a cluster file or enable probe")
        return declared
    from flexpipe_dag.profiling.probe import ProbeSettings, merge_profiles, probe_host

    measured = probe_host(cluster_id or None, ProbeSettings(num_cpu_workers=num_cpu_workers))
    return merge_profiles(declared, measured) if declared else measured
