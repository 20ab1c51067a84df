"""The ``gpu_profile`` asset: a new profile version of the cluster in the SQL store, and its check."""

import pandas as pd
from dagster import AssetCheckResult, AssetCheckSeverity, AssetExecutionContext, MaterializeResult, MetadataValue, asset, asset_check

from flexpipe_dag.assets.metadata import png_metadata, table_metadata
from flexpipe_dag.core.cluster import ClusterProfile
from flexpipe_dag.plots import link_bandwidth_heatmap
from flexpipe_dag.resources.prober import ProberResource
from flexpipe_dag.resources.store_resource import StoreResource

def device_table(profile: ClusterProfile) -> pd.DataFrame:
    """One row per device with the figures the planner uses."""
    return pd.DataFrame([{
        "device": d.device_id, "node": d.node_id, "model": d.model_name, "kind": d.kind,
        "memory_gib": d.memory_gib, "peak_tflops": d.peak_tflops, "hbm_bandwidth_gbps": d.hbm_bandwidth_gbps,
        "max_micro_batch": d.max_micro_batch,
        "available_until": d.available_until.isoformat() if d.available_until else "",
    } for d in profile.devices])

def link_heatmap(profile: ClusterProfile) -> bytes:
    ids = [d.device_id for d in profile.devices]
    grid = [[(l.bandwidth_gbps if (l := profile.link(a, b)) else None) for b in ids] for a in ids]
    return link_bandwidth_heatmap(ids, grid, f"{profile.cluster_id}: link bandwidth (GB/s)")

@asset(group_name="profiling", kinds={"sql"}, pool="device_probe",
       description="A new profile version of the cluster: devices, links, measured timings (SQL store).")
def gpu_profile(context: AssetExecutionContext, prober: ProberResource, store: StoreResource) -> MaterializeResult:
    profile = prober.get_profile()
    db = store.get_store()
    info = db.save_profile(profile)
    cleared = db.clear_health(f"profile refreshed to version {info.version}", cluster_key=profile.cluster_id)
    context.log.info(f"stored {profile.cluster_id} profile v{info.version}: {len(profile.devices)} devices, "
                     f"{len(profile.links)} links; cleared {cleared} health tag(s)")
    for note in profile.notes:
        context.log.info(note)
    return MaterializeResult(metadata={
        "cluster_id": profile.cluster_id,
        "profile_version_id": info.id,
        "version": info.version,
        "source": profile.source,
        "num_devices": len(profile.devices),
        "num_links": len(profile.links),
        "total_memory_gib": float(sum(d.memory_gib for d in profile.devices)),
        "notes": MetadataValue.md("\n".join(f"- {n}" for n in profile.notes) or "-"),
        "devices": table_metadata(device_table(profile)),
        **png_metadata(link_heatmap(profile), f"link_bandwidth_{profile.cluster_id}"),
    })

def profile_problems(profile: ClusterProfile) -> list[str]:
    """Sanity problems of a stored profile (empty list = sane)."""
    ids = {d.device_id for d in profile.devices}
    problems = [f"device {d.device_id}: memory_gib {d.memory_gib} <= 0" for d in profile.devices if not d.memory_gib > 0]
    for l in profile.links:
        for end in (l.src_device_id, l.dst_device_id):
            if end not in ids:
                problems.append(f"link {l.src_device_id}->{l.dst_device_id}: unknown device {end}")
        if not l.bandwidth_gbps > 0:
            problems.append(f"link {l.src_device_id}->{l.dst_device_id}: bandwidth_gbps {l.bandwidth_gbps} <= 0")
    return problems

@asset_check(asset=gpu_profile, description="Every device has memory > 0; every link joins known devices with positive bandwidth.")
def gpu_profile_sane(store: StoreResource) -> AssetCheckResult:
    latest = store.get_store().latest_profile()
    if latest is None:
        return AssetCheckResult(passed=False, severity=AssetCheckSeverity.ERROR, description="no profile stored")
    info, profile = latest
    problems = profile_problems(profile)
    return AssetCheckResult(passed=not problems, severity=AssetCheckSeverity.ERROR,
                            metadata={"profile_version_id": info.id, "problems": MetadataValue.md(
                                "\n".join(f"- {p}" for p in problems) or "none")})
