"""A cluster profile as users read it: the device table and the sanity problems of a profile."""

from __future__ import annotations

import pandas as pd

from flexpipe_dag.core.cluster import ClusterProfile
from flexpipe_dag.plots import link_bandwidth_heatmap

#: Most devices listed one per row; a larger fleet is shown one row per group of alike devices.
TABLE_MAX_DEVICES = 64


def device_table(profile: ClusterProfile) -> pd.DataFrame:
    """One row per device with the figures the planner uses (units in the column names); for more than
    :data:`TABLE_MAX_DEVICES` devices, one row per group of devices with equal figures, with how many
    devices and hosts it holds and its first device."""
    frame = pd.DataFrame([{
        "device": d.device_id, "node": d.node_id, "model": d.model_name, "kind": d.kind,
        "memory_gib": d.memory_gib, "peak_tflops": d.peak_tflops, "hbm_bandwidth_gbps": d.hbm_bandwidth_gbps,
        "max_micro_batch": d.max_micro_batch,
        "available_until": d.available_until.isoformat() if d.available_until else "",
    } for d in profile.devices])
    if len(frame) <= TABLE_MAX_DEVICES:
        return frame
    figures = ["model", "kind", "memory_gib", "peak_tflops", "hbm_bandwidth_gbps", "max_micro_batch", "available_until"]
    grouped = frame.groupby(figures, sort=False, dropna=False).agg(
        devices=("device", "size"), hosts=("node", "nunique"), first_device=("device", "first")).reset_index()
    return grouped[["first_device", "devices", "hosts", *figures]]


#: Most devices the link heatmap draws (a fleet's pairs grow with the square of its devices).
HEATMAP_MAX_DEVICES = 64


def link_heatmap(profile: ClusterProfile) -> bytes:
    """PNG of the pairwise link bandwidth (GB/s) between the profile's devices (the first
    :data:`HEATMAP_MAX_DEVICES` of a larger fleet, the title says so)."""
    ids = [d.device_id for d in profile.devices[:HEATMAP_MAX_DEVICES]]
    grid = [[(link.bandwidth_gbps if (link := profile.link(a, b)) else None) for b in ids] for a in ids]
    shown = "" if len(ids) == len(profile.devices) else f" (first {len(ids)} of {len(profile.devices)} devices)"
    return link_bandwidth_heatmap(ids, grid, f"{profile.cluster_id}: link bandwidth (GB/s){shown}")


def profile_problems(profile: ClusterProfile) -> list[str]:
    """Sanity problems of a profile (empty list = sane): memory <= 0, links to unknown devices or
    with bandwidth <= 0."""
    ids = {d.device_id for d in profile.devices}
    problems = [f"device {d.device_id}: memory_gib {d.memory_gib} <= 0" for d in profile.devices if not d.memory_gib > 0]
    for link in profile.links:
        for end in (link.src_device_id, link.dst_device_id):
            if end not in ids:
                problems.append(f"link {link.src_device_id}->{link.dst_device_id}: unknown device {end}")
        if not link.bandwidth_gbps > 0:
            problems.append(f"link {link.src_device_id}->{link.dst_device_id}: bandwidth_gbps {link.bandwidth_gbps} <= 0")
    return problems
