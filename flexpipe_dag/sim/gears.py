"""Build a hand-specified ("manual") gear without a planner: for measured tables, tests and what-if runs."""

from __future__ import annotations

from typing import Sequence

from flexpipe_dag.core.gear import Gear, StagePlan


def manual_gear(
    layers_per_stage: Sequence[int],
    *,
    replicas: Sequence[int] | None = None,
    gear_id: str = "manual",
    model_name: str = "model",
    micro_batch_size: int = 1,
    max_inflight_micro_batches: int = 1,
    kv_block_size_tokens: int = 16,
    kv_capacity_tokens: int = 0,
    target_p99_ms: float = 1000.0,
) -> Gear:
    """A ``kind="manual"`` gear with stage ``i`` holding ``layers_per_stage[i]`` layers on
    ``replicas[i]`` devices named ``d<i>r<j>`` (device names are placeholders for simulation).

    Raises:
        pydantic.ValidationError: via :class:`Gear` (e.g. an empty stage).
        ValueError: ``replicas`` length differs from ``layers_per_stage``.
    """
    reps = list(replicas) if replicas is not None else [1] * len(layers_per_stage)
    if len(reps) != len(layers_per_stage):
        raise ValueError(f"replicas: expected {len(layers_per_stage)} entries, got {len(reps)}")
    stages, start = [], 0
    for i, (n, r) in enumerate(zip(layers_per_stage, reps)):
        stages.append(StagePlan(stage_index=i, layer_start=start, layer_end=start + n,
                                device_ids=[f"d{i}r{j}" for j in range(r)]))
        start += n
    return Gear(gear_id=gear_id, kind="manual", model_name=model_name, num_layers=start, stages=stages,
                micro_batch_size=micro_batch_size, max_inflight_micro_batches=max_inflight_micro_batches,
                kv_block_size_tokens=kv_block_size_tokens, kv_capacity_tokens=kv_capacity_tokens,
                target_p99_ms=target_p99_ms)
