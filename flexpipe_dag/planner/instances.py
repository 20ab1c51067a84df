"""Seeded random heterogeneous instances for checking the search against the exhaustive oracle.

Devices are drawn from the GPU catalog (datasheet figures), grouped on 1-3 hosts; links inside a host
use the GPU's NVLink or PCIe figure, links between hosts 12.5 GB/s (100 GbE) unless ``fast_links``.
Models are small Llama-shaped configurations.
"""

from __future__ import annotations

import numpy as np

from flexpipe_dag.core.catalog import gpu_catalog
from flexpipe_dag.core.cluster import ClusterProfile, Device, Link
from flexpipe_dag.planner.model_spec import ModelSpec


def random_cluster(rng: np.random.Generator, num_devices: int, fast_links: bool = False) -> ClusterProfile:
    """``num_devices`` random catalog GPUs on up to 3 hosts, fully linked."""
    catalog = gpu_catalog()
    names = sorted(catalog)
    kinds = rng.choice(names, size=min(3, num_devices), replace=False)
    devices = []
    for i in range(num_devices):
        spec = catalog[str(kinds[rng.integers(len(kinds))])]
        devices.append(Device(device_id=f"d{i}", node_id=f"h{int(rng.integers(3))}", model_name=spec.model_name,
                              memory_gib=spec.memory_gib, peak_tflops=spec.peak_tflops,
                              hbm_bandwidth_gbps=spec.hbm_bandwidth_gbps, compute_score=spec.compute_score))
    links = []
    for a in devices:
        for b in devices:
            if a is b:
                continue
            if fast_links:
                bw, lat = 300.0, 3.0
            elif a.node_id == b.node_id:
                sa = catalog[a.model_name]
                bw, lat = (sa.nvlink_gbps or sa.pcie_gbps), 5.0
            else:
                bw, lat = 12.5, 25.0
            links.append(Link(src_device_id=a.device_id, dst_device_id=b.device_id, bandwidth_gbps=bw, latency_us=lat))
    return ClusterProfile(cluster_id=f"random-{num_devices}", devices=devices, links=links)


def random_model(rng: np.random.Generator, num_layers: int) -> ModelSpec:
    """A Llama-shaped model with ``num_layers`` layers and a random width (1-8 B-parameter class layers)."""
    head_dim = 128
    heads = int(rng.choice([16, 32, 40, 64]))
    kv = int(rng.choice([h for h in (1, 2, 4, 8, heads) if heads % h == 0]))
    hidden = heads * head_dim
    return ModelSpec(name=f"rand-{num_layers}L-{hidden}", num_layers=num_layers, hidden_size=hidden, num_heads=heads,
                     num_kv_heads=kv, head_dim=head_dim, intermediate_size=int(hidden * rng.choice([2.7, 3.5])) // 64 * 64,
                     vocab_size=int(rng.choice([32000, 128256])), source="random")
