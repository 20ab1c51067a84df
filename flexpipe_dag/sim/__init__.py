"""Discrete-event simulator of pipeline-parallel LLM serving (pure Python / numpy, deterministic).

Drive it with any :class:`~flexpipe_dag.core.timing.StageTimingModel` (the planner's cost model or
:class:`LinearStageTiming` from measured tables) and a :class:`~flexpipe_dag.core.gear.Gear`.
"""

from __future__ import annotations

from collections.abc import Sequence

from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.gear_builders import manual_gear
from flexpipe_dag.core.timing import StageTimingModel
from flexpipe_dag.sim.config import SimConfig
from flexpipe_dag.sim.engine import Simulator
from flexpipe_dag.sim.evaluate import GearEvaluation, estimate_from_result, evaluate_gear, plot_evaluation
from flexpipe_dag.sim.results import ShiftEvent, SimResult, summarize
from flexpipe_dag.sim.timing import COST_FIELDS, LinearStageTiming, StageCosts
from flexpipe_dag.workload.request import Workload


def simulate(workload: Workload, gear: Gear, timing: StageTimingModel, config: SimConfig | None = None) -> SimResult:
    """Replay ``workload`` through ``gear`` (stage times from ``timing``) and return the result."""
    return Simulator(workload, gear, timing, config).run()


def simulate_schedule(
    workload: Workload,
    schedule: Sequence[tuple[float, Gear, StageTimingModel]],
    config: SimConfig | None = None,
    *,
    ready_in_s: float = 0.0,
) -> SimResult:
    """Replay ``workload`` with gear shifts at fixed times.

    Args:
        schedule: ``[(t_s, gear, timing), ...]`` sorted by ``t_s``; the first entry (any ``t_s``)
            is the starting gear, each later one is shifted to at ``t_s`` (drain of the old one,
            admissions on the new one after ``ready_in_s``).
    """
    if not schedule:
        raise ValueError("schedule: expected at least one (t_s, gear, timing) entry")
    _, gear0, timing0 = schedule[0]
    sim = Simulator(workload, gear0, timing0, config)
    for t_s, gear, timing in schedule[1:]:
        sim.advance(t_s)
        sim.shift_gear(gear, timing, ready_in_s=ready_in_s)
    return sim.run()


__all__ = ["COST_FIELDS", "GearEvaluation", "estimate_from_result", "evaluate_gear", "plot_evaluation",
           "LinearStageTiming", "ShiftEvent", "SimConfig", "SimResult", "Simulator", "StageCosts",
           "manual_gear", "simulate", "simulate_schedule", "summarize"]
