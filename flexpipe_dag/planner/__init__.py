"""Gear planner: model profile, roofline cost model, heterogeneous pipeline search, gears.

Pure Python / numpy (no torch, Dagster or SQL imports). Entry points::

    spec = load_model_spec("Llama-3-8B")                  # or a config.json dir / .gguf file
    gears = plan_gears(cluster, spec, dtype="bf16", context_p95_tokens=4096, concurrency=64)
    timing = CostModel(spec, cluster).timings(gears[2])  # StageTimingModel for the simulator
"""

from flexpipe_dag.planner.cost_model import CostModel, Efficiency, GearTiming, default_efficiency
from flexpipe_dag.planner.gears import make_search, plan_baseline, plan_gears, plan_kind, to_gear
from flexpipe_dag.planner.model_spec import ModelSpec, builtin_model_names, load_model_spec, smollm2_gguf_path
from flexpipe_dag.planner.workload import PlanWorkload

__all__ = [
    "CostModel", "Efficiency", "GearTiming", "ModelSpec", "PlanWorkload", "builtin_model_names",
    "default_efficiency", "load_model_spec", "make_search", "plan_baseline", "plan_gears", "plan_kind",
    "smollm2_gguf_path", "to_gear",
]
