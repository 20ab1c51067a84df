"""Independent re-check of a stored gear against the cluster it runs on (the ``candidate_gears`` asset check).

The planner only emits gears that fit; this check re-derives each stage's memory and each adjacent
link's traffic from the gear alone, so a hand-edited gear, a profile that changed underneath, or a
planner bug is caught before a gear is run.
"""

from __future__ import annotations

from flexpipe_dag.core.cluster import ClusterProfile
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.planner.model_spec import ModelSpec

GIB = 2**30


def gear_problems(gear: Gear, cluster: ClusterProfile, model: ModelSpec, *, reserve_fraction: float = 0.10,
                  link_utilisation_max: float = 0.7) -> list[str]:
    """What is wrong with ``gear`` on ``cluster`` (empty list = it fits memory and links).

    Memory, per replica device of each stage: weights (``weight_gib``) + its share of the stage's KV
    pool (``kv_capacity_tokens / replicas`` x per-layer KV bytes per token x layers) must not exceed
    ``Device.usable_memory_gib(reserve_fraction)`` (reported total less the CUDA context reserve, less
    the fraction). Links: every replica of stage ``i`` needs a link to every
    replica of stage ``i + 1``, and the estimated traffic (tokens/s x activation bytes per token) must
    stay within ``link_utilisation_max`` of its bandwidth.
    """
    problems: list[str] = []
    known = {d.device_id for d in cluster.devices}
    kv_layer_token = model.kv_bytes_per_token_per_layer(gear.dtype)
    for st in gear.stages:
        missing = [d for d in st.device_ids if d not in known]
        if missing:
            problems.append(f"{gear.gear_id} stage {st.stage_index}: unknown device(s) {', '.join(missing)}")
            continue
        weight_bytes = (st.weight_gib or 0.0) * GIB
        kv_bytes = (st.kv_capacity_tokens or 0) / st.replicas * kv_layer_token * st.num_layers
        for dev_id in st.device_ids:
            usable = cluster.device(dev_id).usable_memory_gib(reserve_fraction) * GIB
            if weight_bytes + kv_bytes > usable * (1 + 1e-9):
                problems.append(f"{gear.gear_id} stage {st.stage_index} on {dev_id}: weights {weight_bytes / GIB:.2f} GiB"
                                f" + KV {kv_bytes / GIB:.2f} GiB exceed {usable / GIB:.2f} GiB usable")
    tokens_per_s = gear.estimate.tokens_per_s if gear.estimate else 0.0
    traffic_gbps = tokens_per_s * model.activation_bytes_per_token(gear.dtype) / 1e9
    for a, b in zip(gear.stages, gear.stages[1:]):
        for src in a.device_ids:
            for dst in b.device_ids:
                if src not in known or dst not in known:
                    continue
                link = cluster.link(src, dst)
                if link is None:
                    problems.append(f"{gear.gear_id}: no link {src} -> {dst} between stages {a.stage_index} and {b.stage_index}")
                elif traffic_gbps > link_utilisation_max * link.bandwidth_gbps:
                    problems.append(f"{gear.gear_id}: link {src} -> {dst} carries {traffic_gbps:.3g} GB/s, over "
                                    f"{link_utilisation_max:.0%} of {link.bandwidth_gbps:.3g} GB/s")
    return problems
