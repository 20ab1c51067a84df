"""Independent re-check of a stored gear against the cluster it runs on (the ``candidate_gears`` asset check).

The planner only emits gears that fit; this check re-derives each stage's memory and each adjacent
link's traffic from the gear alone, so a hand-edited gear, a profile that changed underneath, or a
planner bug is caught before a gear is run.
"""

from __future__ import annotations

from flexpipe_dag.core.cluster import ClusterProfile
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import MAX_KV_CAPACITY_TOKENS, Gear
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.planner.workload import PlanWorkload

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


def fit_gear_to_devices(gear: Gear, cluster: ClusterProfile, model: ModelSpec, dtype: str, *, source: str,
                        workload: PlanWorkload | None = None) -> tuple[Gear, list[str]]:
    """``gear`` with each stage's weights and KV pool re-derived from ``model`` and the devices it names, as the
    planner sizes them (:func:`~flexpipe_dag.planner.gears.to_gear`), and what changed from the gear's own figures.

    A gear read from a file may have been edited: its ``weight_gib`` and ``kv_capacity_tokens`` (0 read as
    unbounded by the simulator) are not trusted. Per stage: weights ``ModelSpec.stage_weight_bytes`` in ``dtype``
    plus the activation workspace (``max(micro-batch, workload.prefill_chunk_tokens)`` tokens) must fit the
    smallest replica device's ``usable_memory_gib(workload.reserve_fraction)``; the KV pool is what is left, in
    tokens (per-layer KV bytes x the stage's layers), times the replicas; the gear's pool is the smallest stage's.

    Returns:
        ``(the gear with re-derived stage weight_gib / kv_capacity_tokens and gear kv_capacity_tokens, one line per
        figure that differed from the gear's own)``.

    Raises:
        InputError: (``source``, ``stages[i]``) a stage's weights and workspace exceed a device's usable memory,
            leave no room for one KV block of its layers, or ``dtype`` is bf16 on a device without bf16; a device the
            cluster does not have.
    """
    w = workload or PlanWorkload()
    known = {d.device_id for d in cluster.devices}
    kv_layer_token = model.kv_bytes_per_token_per_layer(dtype)
    ws = max(gear.micro_batch_size, w.prefill_chunk_tokens) * model.activation_workspace_bytes_per_token(dtype)
    stages, changed = [], []
    last_index = gear.num_stages - 1
    for st in gear.stages:
        field = f"stages[{st.stage_index}]"
        missing = [d for d in st.device_ids if d not in known]
        if missing:
            raise InputError(source, f"{field}.device_ids", f"device {missing[0]!r} is not in cluster {cluster.cluster_id!r}")
        devices = [cluster.device(d) for d in st.device_ids]
        if dtype == "bf16" and any(d.lacks_bf16 for d in devices):
            lacking = next(d.device_id for d in devices if d.lacks_bf16)
            raise InputError(source, field, f"device {lacking} has no bf16 math; expected dtype fp16 (--dtype fp16)")
        weight = model.stage_weight_bytes(st.num_layers, st.stage_index == 0, st.stage_index == last_index, dtype)
        smallest = min(devices, key=lambda d: d.usable_memory_gib(w.reserve_fraction))
        usable = smallest.usable_memory_gib(w.reserve_fraction) * GIB
        kv_tokens = int((usable - weight - ws) // (kv_layer_token * st.num_layers)) if usable > weight + ws else 0
        if kv_tokens < gear.kv_block_size_tokens:
            raise InputError(source, field, f"layers {st.layer_start}-{st.layer_end} of {model.name} in {dtype}: "
                             f"weights {weight / GIB:.2f} GiB + workspace {ws / GIB:.2f} GiB leave no room for a KV "
                             f"block on {smallest.device_id} ({usable / GIB:.2f} GiB usable after the CUDA context and "
                             f"the {w.reserve_fraction:.0%} reserve)")
        kv_tokens = min(kv_tokens * st.replicas, MAX_KV_CAPACITY_TOKENS)
        for name, theirs, ours, form in (("weight_gib", st.weight_gib, round(weight / GIB, 4), "{:g} GiB"),
                                         ("kv_capacity_tokens", st.kv_capacity_tokens, kv_tokens, "{:.0f} tokens")):
            if theirs is not None and abs(theirs - ours) > 1e-3 * max(1.0, ours):
                changed.append(f"{field}.{name}: the file says {form.format(theirs)}, the devices hold {form.format(ours)}")
        stages.append(st.model_copy(update={"weight_gib": round(weight / GIB, 4), "kv_capacity_tokens": kv_tokens}))
    pool = min(s.kv_capacity_tokens or 0 for s in stages)
    if gear.kv_capacity_tokens is not None and gear.kv_capacity_tokens != pool:
        changed.append(f"kv_capacity_tokens: the file says {gear.kv_capacity_tokens} tokens (0 = unbounded), the "
                       f"devices hold {pool}")
    return gear.model_copy(update={"stages": stages, "kv_capacity_tokens": pool}), changed
