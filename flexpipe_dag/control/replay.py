"""Replaying a tide-shaped trace on static gears and under the gear-shift controller, in the simulator.

The shared machinery of ``bench/shift_bench.py`` (online shifting vs static gears) and the mixed-day
simulation (:mod:`flexpipe_dag.control.mixed_day`): a static run, a controller-driven run with shift
warm-ups over the cluster's links, the per-window SLO counts, and when a run hands its devices back.
Pure: numpy and the simulator, no Dagster or SQL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flexpipe_dag.control.config import ControllerConfig
from flexpipe_dag.control.controller import Controller, ForecastFn
from flexpipe_dag.control.migration import drain_time_s, migration_cost_fn, weight_transfer_s
from flexpipe_dag.control.offline_share import OfflineShare
from flexpipe_dag.control.state import Decision
from flexpipe_dag.core.cluster import ClusterProfile
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.metrics import MetricSample
from flexpipe_dag.core.timing import StageTimingModel
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.sim import SimConfig, Simulator
from flexpipe_dag.sim.results import SimResult
from flexpipe_dag.workload.request import Workload

#: Share of requests that must meet the SLO: the bar envelopes are measured at, and the one a gear must
#: clear in a window to count as holding that window's load.
ATTAINMENT = 0.95

#: Controller figures beyond the design's seeds that tide replays set (each off in the seeds), with its
#: value and what it does; README, "Controller and tide figures".
REPLAY_CONTROLLER: dict[str, tuple[float, str]] = {
    "device_weight": (0.2, "cost of devices held on discretionary shifts (seed 0)"),
    "forecast_horizon_s": (600.0, "look-ahead of the load forecast, simulated s (seed 0 = none); the forecast is the "
                                  "ServeGen tide's daily profile over the other 13 days"),
    "rps_ema_alpha": (0.1, "EMA weight of the arrival rate (seed: ema_alpha 0.3)"),
    "recent_peak_window_s": (600.0, "a shift down must hold this window's peak load (seed 0)"),
    "reversal_window_s": (1800.0, "a discretionary shift may not undo the previous one this soon (seed 0)"),
}


def replay_controller_config(slo_ttft_ms: float, **overrides: float) -> ControllerConfig:
    """The controller tide replays use: the design's seeds, latency target = the TTFT SLO, plus
    :data:`REPLAY_CONTROLLER`'s figures; ``overrides`` set any figure by name (those of
    :data:`REPLAY_CONTROLLER` or others, e.g. the mixed day's ``downshift_headroom_fraction``).

    Raises:
        pydantic.ValidationError: a figure out of its range, or an unknown one (the field is named).
    """
    seed = ControllerConfig(target_p99_ms=slo_ttft_ms, latency_metric="ttft_p99_ms")
    figures = {field: default for field, (default, _) in REPLAY_CONTROLLER.items()} | overrides
    return ControllerConfig.model_validate(seed.model_dump() | figures)


def lost_count(summary: Mapping[str, Any]) -> int:
    """Requests a run lost: unfinished plus rejected (a run's ``SimResult.summary``)."""
    return int(summary["unfinished"]) + int(summary["rejected"])


def online_outcome(result: SimResult) -> tuple[float, int]:
    """``(requests within SLO, requests lost)`` among a run's online requests (offline work fed in is left out)."""
    df = result.requests
    online = df[df["class"] == "online"]
    lost = int(online["finish_s"].isna().sum())  # rejected ones never finish
    return float(online["slo_met"].sum()), lost


def hold_end_s(result: SimResult, duration_s: float) -> float:
    """When a run hands its devices back: its last request's finish, but not before the replay ends, s."""
    finish = result.requests["finish_s"].to_numpy(dtype=float)
    finish = finish[~np.isnan(finish)]
    return max(float(duration_s), float(finish.max()) if finish.size else 0.0)


def run_static(workload: Workload, gear: Gear, timing: StageTimingModel, sim_config: SimConfig) -> SimResult:
    """Serve the whole replay on one gear; the simulator's :class:`~flexpipe_dag.sim.results.SimResult`."""
    return Simulator(workload, gear, timing, sim_config).run()


def window_index(times_s: np.ndarray, window_s: float, num_windows: int) -> np.ndarray:
    """The window each time falls in (``t // window_s``, the last window taking anything later)."""
    idx: np.ndarray = np.minimum((np.asarray(times_s, dtype=float) // window_s).astype(int), num_windows - 1)
    return idx


def slo_met_per_window(result: SimResult, window_s: float, num_windows: int) -> np.ndarray:
    """Requests meeting both SLOs, counted by the window of their arrival; shape ``(num_windows,)``."""
    df = result.requests
    idx = window_index(df["arrival_s"].to_numpy(), window_s, num_windows)
    counts: np.ndarray = np.bincount(idx, weights=df["slo_met"].to_numpy(dtype=float), minlength=num_windows)
    return counts


def arrivals_per_window(workload: Workload, window_s: float, num_windows: int) -> np.ndarray:
    """Requests arriving in each window; shape ``(num_windows,)``."""
    arrival_s = np.array([r.arrival_s for r in workload.requests], dtype=float)
    return np.bincount(window_index(arrival_s, window_s, num_windows), minlength=num_windows)


def cheapest_holding_gear(gears: Sequence[Gear], met_in_window: Mapping[str, float], arrivals: float,
                          attainment: float = ATTAINMENT) -> Gear:
    """The gear on the fewest devices whose static run met the SLO for >= ``attainment`` of a window's
    ``arrivals`` (ties: more requests within SLO); when none does, the one meeting it for most.

    Args:
        met_in_window: per gear id, requests arriving in the window that met the SLO in its static run.
    """
    holding = [g for g in gears if met_in_window[g.gear_id] >= attainment * arrivals]
    if holding:
        return min(holding, key=lambda g: (len(g.device_ids), -met_in_window[g.gear_id]))
    return max(gears, key=lambda g: met_in_window[g.gear_id])


def opening_gear(workload: Workload, gears: Sequence[Gear], head_requests: int = 200) -> Gear:
    """The gear a replay starts in: the first whose envelope holds the opening load (the rate of the
    first ``head_requests`` arrivals), else the one with the smallest envelope."""
    if not gears:
        raise ValueError("gears: expected at least one gear")
    k = min(len(workload) - 1, head_requests)
    opening = workload.requests[k].arrival_s if k >= 0 else 0.0
    opening_rps = k / opening if opening > 0 else 0.0
    fitting = [g for g in gears if g.rps_min <= opening_rps <= g.rps_max]
    return (fitting or sorted(gears, key=lambda g: g.rps_max))[0]


@dataclass(frozen=True)
class ShiftTaken:
    """A shift the controller took in a replay and the warm-up it was given (weight transfer), s."""

    decision: Decision
    warm_s: float


def run_dynamic(workload: Workload, gears: Sequence[Gear], timings: Mapping[str, StageTimingModel], start_gear: Gear,
                sim_config: SimConfig, controller: Controller, cluster: ClusterProfile, spec: ModelSpec, dtype: str,
                output_tokens_mean: float, verbose: bool = False,
                forecast: ForecastFn | None = None, offline: OfflineShare | None = None,
                decide_until_s: float | None = None) -> tuple[SimResult, list[ShiftTaken]]:
    """Serve the replay with the controller deciding at every metric sample.

    A shift's shadow warm-up takes the weight transfer time over the cluster's links
    (:func:`~flexpipe_dag.control.migration.weight_transfer_s`); the old gear then drains while the new
    one admits. The controller's migration cost adds the expected drain (in-flight requests half-way
    through ``output_tokens_mean`` output tokens at the newest sample's TPOT).

    Args:
        timings: stage times per gear id.
        forecast: the controller's load forecast (``(t_s, rps, horizon_s) -> req/s``), or None.
        verbose: print every shift's reason as it happens.
        offline: offline work fed into the serving gear's spare capacity at every sample (the serve loop's
            trough rule, :class:`~flexpipe_dag.control.offline_share.OfflineShare`), or None; the caller
            settles it on the result.
        decide_until_s: the controller decides only on samples up to this time (the end of the day; what
            runs after it only finishes), s; None = until the replay ends.

    Returns:
        The simulator's result and the shifts taken, in time order.
    """
    layer_bytes = [spec.layer_weight_bytes(dtype)] * spec.num_layers
    extras = dict(embedding_bytes=spec.first_stage_extra_bytes(dtype), lm_head_bytes=spec.last_stage_extra_bytes(dtype))
    by_id = {g.gear_id: g for g in gears}
    sim = Simulator(workload, start_gear, timings[start_gear.gear_id], sim_config)
    last: dict[str, MetricSample | None] = {"sample": None}

    def drain_s(old_gear: Gear) -> float:
        s = last["sample"]
        if s is None:
            return 0.0
        tpot = s.tpot_p50_ms if s.tpot_p50_ms is not None else (old_gear.estimate.tpot_p50_ms if old_gear.estimate else 0.0)
        # in-flight requests are on average half-way through their output
        return drain_time_s(s.running, output_tokens_mean / 2.0, tpot)

    cost_fn = migration_cost_fn(cluster, layer_bytes, drain_s=drain_s, **extras)
    state, shifts = None, []
    period = sim_config.sample_period_s
    while not sim.finished:
        samples = sim.advance(sim.now_s + period)
        if not samples:
            continue
        last["sample"] = samples[-1]
        if offline is not None:
            offline.step(sim, samples[-1], by_id[sim.gear_id], forecast)
        if decide_until_s is not None and samples[-1].t_s > decide_until_s:
            continue
        state, decision = controller.decide(state, samples, list(gears), migration_cost_s=cost_fn, now_s=samples[-1].t_s,
                                            forecast=forecast)
        if decision.action == "shift":
            assert decision.from_gear_id is not None and decision.to_gear_id is not None
            old, new = by_id[decision.from_gear_id], by_id[decision.to_gear_id]
            warm_s = weight_transfer_s(old, new, cluster, layer_bytes, **extras)
            sim.shift_gear(new, timings[new.gear_id], ready_in_s=warm_s)
            shifts.append(ShiftTaken(decision, warm_s))
            if verbose:
                print(f"  t={decision.t_s:7.0f} s  {decision.reason}  [warm-up {warm_s:.2f} s]")
    return sim.result(), shifts
