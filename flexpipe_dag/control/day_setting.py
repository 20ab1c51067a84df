"""What a mixed day runs on: the operating gears, a day of the tide, the controller's forecast.

The same steps ``bench/shift_bench.py`` takes, for ``flexpipe simulate --day``, ``bench/mixed_day.py``
and the ``mixed_day`` asset: gears chosen by simulation from the planner's shortlist (or the
planner's analytic picks), the Azure conversation trace time-warped to one day of the ServeGen tide
and compressed, its peak at a share of the largest envelope, and a forecast that never sees the
replayed day (the tide's daily profile over the other days).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from flexpipe_dag.control.controller import ForecastFn
from flexpipe_dag.control.mixed_day import DaySetting
from flexpipe_dag.control.replay import ATTAINMENT
from flexpipe_dag.control.tide import TideForecaster, tide_forecast
from flexpipe_dag.core.cluster import ClusterProfile
from flexpipe_dag.core.errors import InfeasibleError, InputError
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.timing import StageTimingModel
from flexpipe_dag.planner.envelope import SelectionSettings, refine_envelopes, select_operating_gears
from flexpipe_dag.planner.gears import candidate_gears, make_search, plan_gear_set
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.sim import SimConfig
from flexpipe_dag.workload import load_tide_trace, load_trace, shape_by_tide
from flexpipe_dag.workload.request import Workload

GearSource = Literal["sim", "planner"]
#: The online trace a tide day is shaped from (bundled, CC-BY-4.0).
ONLINE_TRACE = "azure-conv"


@dataclass(frozen=True)
class OperatingGears:
    """The gears a day shifts between, their stage times (by gear id) and how they were chosen."""

    gears: list[Gear]
    timings: dict[str, StageTimingModel]
    notes: list[str]


def operating_gears(cluster: ClusterProfile, spec: ModelSpec, *, dtype: str, slo_ttft_ms: float, slo_tpot_ms: float,
                    source: GearSource = "sim") -> OperatingGears:
    """The latency / balanced / throughput gears with simulated envelopes.

    ``source="sim"``: chosen by simulation from the planner's shortlist by goodput per device
    (:func:`~flexpipe_dag.planner.envelope.select_operating_gears`, objective ``devices``; minutes on
    a large fleet); ``"planner"``: the planner's analytic picks, envelopes then simulated.

    Raises:
        InfeasibleError: no gear fits the fleet.
    """
    cm = make_search(cluster, spec, dtype=dtype).cm
    reference = load_trace(ONLINE_TRACE)
    if source == "sim":
        shortlist = candidate_gears(cluster, spec, dtype=dtype)
        settings = SelectionSettings(slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, attainment=ATTAINMENT,
                                     rel_tol=0.05)
        selection = select_operating_gears(shortlist, cm, reference, settings, objective="devices")
        gears, notes = list(selection.gears), list(selection.notes)
        notes.insert(0, f"chosen by simulation from {len(shortlist)} planner candidates, objective devices")
    else:
        gear_set = plan_gear_set(cluster, spec, dtype=dtype)
        refined = refine_envelopes(gear_set.gears, cm, reference, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                                   attainment=ATTAINMENT)
        gears, dropped = undominated(refined)
        notes = list(gear_set.notes) + dropped
        if not gears:
            raise InfeasibleError(f"none of the planner's gears meets TTFT {slo_ttft_ms:g} ms / TPOT {slo_tpot_ms:g} ms "
                                  f"for {ATTAINMENT:.0%} of requests at any rate")
    return OperatingGears(gears, {g.gear_id: cm.timings(g) for g in gears}, notes)


def undominated(gears: list[Gear]) -> tuple[list[Gear], list[str]]:
    """``(gears kept, a note per gear left out)``: a gear whose measured envelope is 0, or that another gear beats
    (no more devices, at least its ``rps_max``, better in one of the two), is left out. The planner's analytic kinds
    need not survive measurement: on the lab fleet its 7-device "throughput" gear measured 5.76 req/s beside a
    2-device gear's 9.99, and a mixed day run on it held 2.1x the static reservation."""
    kept: list[Gear] = []
    notes: list[str] = []
    for g in gears:
        if not g.rps_max > 0:
            notes.append(f"{g.gear_id} left out: it meets the SLO at no rate")
            continue
        better = next((o for o in gears if o is not g and o.rps_max > 0 and len(o.device_ids) <= len(g.device_ids)
                       and o.rps_max >= g.rps_max and (len(o.device_ids) < len(g.device_ids) or o.rps_max > g.rps_max)),
                      None)
        if better is not None:
            notes.append(f"{g.gear_id} left out: {better.gear_id} serves {better.rps_max:.2f} req/s on "
                         f"{len(better.device_ids)} device(s), it {g.rps_max:.2f} on {len(g.device_ids)}")
            continue
        kept.append(g)
    return kept, notes


def tide_day(*, start_day: int, duration_s: float, peak_rps: float) -> Workload:
    """The online trace shaped by day ``start_day`` of the ServeGen tide, compressed into ``duration_s``.

    Raises:
        InputError: a day outside the tide, or ``duration_s`` / ``peak_rps`` not > 0.
    """
    tide = load_tide_trace()
    days = int(tide.duration_s // 86400)
    if not 0 <= start_day < days:
        raise InputError("mixed day", "start_day", f"the ServeGen tide holds days 0..{days - 1}, got {start_day}")
    for name, value in (("duration_s", duration_s), ("peak_rps", peak_rps)):
        if not (math.isfinite(value) and value > 0):
            raise InputError("mixed day", name, f"got {value}; expected a finite number > 0")
    return shape_by_tide(load_trace(ONLINE_TRACE), tide, compression=86400.0 / duration_s, start_s=86400.0 * start_day,
                         duration_s=duration_s, peak_rps=peak_rps, name=f"{ONLINE_TRACE}@servegen-tide-day{start_day}")


def leave_one_out_forecast(start_day: int, duration_s: float) -> ForecastFn:
    """The controller's forecast for a replay of ``start_day``: the tide's daily profile over the other days."""
    tide = load_tide_trace()
    compression = 86400.0 / duration_s
    return tide_forecast(TideForecaster(tide.without_days([start_day])),
                         lambda t_s: 86400.0 * start_day + compression * t_s, compression)


def day_setting(cluster: ClusterProfile, spec: ModelSpec, dtype: str, gears: OperatingGears, *, start_day: int,
                duration_s: float, slo_ttft_ms: float, slo_tpot_ms: float, peak_share: float = 0.95,
                peak_rps: float | None = None, window_s: float = 600.0) -> DaySetting:
    """A :class:`~flexpipe_dag.control.mixed_day.DaySetting` for one tide day, its peak at ``peak_rps`` req/s,
    by default ``peak_share`` x the largest finite envelope (the biggest gear can just hold it).

    Raises:
        InputError: as :func:`tide_day`; ``peak_share`` not in (0, 1.5]; no gear with a finite envelope
            (without ``peak_rps``).
    """
    if peak_rps is None:
        if not 0 < peak_share <= 1.5:
            raise InputError("mixed day", "peak_share", f"got {peak_share}; expected 0 < share <= 1.5")
        finite = [g.rps_max for g in gears.gears if math.isfinite(g.rps_max) and g.rps_max > 0]
        if not finite:
            raise InputError("mixed day", "gears", "no gear has a finite envelope (rps_max) to size the peak by")
        peak_rps = peak_share * max(finite)
    workload = tide_day(start_day=start_day, duration_s=duration_s, peak_rps=peak_rps)
    return DaySetting(workload=workload, duration_s=duration_s, cluster=cluster, spec=spec, dtype=dtype,
                      gears=gears.gears, timings=gears.timings,
                      sim_config=SimConfig(slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms), window_s=window_s)
