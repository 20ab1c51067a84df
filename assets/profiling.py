"""The ``gpu_profile`` asset: a new profile version of the cluster in the SQL store, and its check."""

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    MaterializeResult,
    MetadataValue,
    asset,
    asset_check,
)

from flexpipe_dag.assets.metadata import png_metadata, table_metadata
from flexpipe_dag.profiling.summary import device_table, link_heatmap, profile_problems
from flexpipe_dag.resources.prober import ProberResource
from flexpipe_dag.resources.store_resource import StoreResource


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
        "num_hosts": len(profile.topology.hosts) if profile.topology is not None else 0,
        "total_memory_gib": float(sum(d.memory_gib for d in profile.devices)),
        "notes": MetadataValue.md("\n".join(f"- {n}" for n in profile.notes) or "-"),
        "devices": table_metadata(device_table(profile)),
        **png_metadata(link_heatmap(profile), f"link_bandwidth_{profile.cluster_id}"),
    })

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
