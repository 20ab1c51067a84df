"""A day of tide-shaped traffic on a whole fleet: fleet gears scaled out and in, window by window.

A day on a 1,000-GPU fleet is tens of millions of requests: too many to simulate one by one in a
minute. This model plays the day in windows of ``window_s`` (default 60 s) and takes each instance's
behaviour from its **attainment curve** (:mod:`flexpipe_dag.planner.fleet_curve`: the discrete-event
simulator's SLO attainment of that instance at each load), so the request-level work is done once per
instance shape, not once per request:

* the router spreads the window's rate over the admitting instances in proportion to their
  envelopes (what least outstanding work per unit of capacity converges to, :mod:`flexpipe_dag.sim.fleet`),
  so every admitting instance runs at the same load fraction ``rho = rate / sum(rps_max)``;
* the window's attainment is the load-weighted mean of the instances' curves at ``rho`` (at most at
  each curve's *saturation*, the load where it falls below the target attainment);
* beyond saturation a **backlog** builds: requests the instances cannot serve in time queue, carried
  from window to window and drained when the load falls; a request that arrives behind more queued
  requests than the instances serve within the TTFT SLO misses it;
* devices are held from the decision that starts an instance (its warm-up, ``instance_warmup_s``,
  during which it admits nothing) until ``instance_drain_s`` after the decision that removes it;
* the policy is a fixed instance count (a static fleet gear) or a :class:`~flexpipe_dag.control.fleet_scaler.FleetScaler`
  fed the rate observed in the previous window (and a forecast).

What the model leaves out, and how that is checked: the backlog is one queue for the whole fleet (in the
router's instances each holds its own; a new instance drains none of an old one's queue), and latency
inside a window comes from the curves, not from the window's own burstiness beyond the trace's. ``tests/test_fleet_day.py`` compares this
model with the exact fleet simulator (:class:`~flexpipe_dag.sim.fleet.FleetSimulator`, request by
request) on a small fleet over a compressed tide: attainment and device-hours agree within the
tolerances stated there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from flexpipe_dag.control.controller import ForecastFn
from flexpipe_dag.control.day_setting import leave_one_out_forecast
from flexpipe_dag.control.fleet_scaler import FleetDecision, FleetScaler, FleetScalerConfig
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.settings import check_number
from flexpipe_dag.planner.fleet import FleetPlan, FleetSettings
from flexpipe_dag.planner.fleet_curve import AttainmentCurve
from flexpipe_dag.sim.fleet import InstanceChange
from flexpipe_dag.workload import load_tide_trace


@dataclass(frozen=True)
class FleetDayResult:
    """One day (or any span) of a fleet policy.

    Attributes:
        policy: ``static-<n>`` or ``dynamic``.
        window_s: window length, s.
        offered_rps: shape ``(k,)``, the rate of each window, req/s.
        admitting: shape ``(k,)``, instances admitting in each window.
        held_devices: shape ``(k,)``, devices held (serving, warming or draining) in each window.
        attainment: shape ``(k,)``, share of the window's requests meeting the SLO.
        instances: one row per instance used: ``instance_id``, ``devices``, ``device_hours``,
            ``mean_load_fraction`` (its load / its envelope while admitting), ``requests``.
        decisions: the scaler's changes (empty for a static policy).
        wall_s: the model's own run time, s.
    """

    policy: str
    window_s: float
    offered_rps: np.ndarray
    admitting: np.ndarray
    held_devices: np.ndarray
    attainment: np.ndarray
    instances: pd.DataFrame
    decisions: tuple[FleetDecision, ...] = field(default=())
    wall_s: float = 0.0

    @property
    def requests(self) -> float:
        return float(np.sum(self.offered_rps) * self.window_s)

    @property
    def slo_attainment(self) -> float:
        """Share of the day's requests meeting the SLO (windows weighted by their requests)."""
        w = self.offered_rps * self.window_s
        return float(np.sum(w * self.attainment) / np.sum(w)) if np.sum(w) > 0 else math.nan

    @property
    def device_hours(self) -> float:
        return float(np.sum(self.held_devices) * self.window_s / 3600.0)

    @property
    def duration_h(self) -> float:
        return len(self.offered_rps) * self.window_s / 3600.0

    @property
    def shifts_per_hour(self) -> float:
        return len(self.decisions) / self.duration_h if self.duration_h > 0 else 0.0

    def summary(self) -> dict[str, float | int | str]:
        """Plain figures for tables and asset metadata."""
        return {"policy": self.policy, "slo_attainment": round(self.slo_attainment, 4),
                "device_hours": round(self.device_hours, 1), "mean_held_devices": round(float(np.mean(self.held_devices)), 1),
                "peak_held_devices": int(np.max(self.held_devices)), "shifts": len(self.decisions),
                "shifts_per_hour": round(self.shifts_per_hour, 2), "requests": round(self.requests),
                "wall_s": round(self.wall_s, 3)}


def _check(plan: FleetPlan, curves: Mapping[int, AttainmentCurve], rates_rps: np.ndarray, window_s: float) -> None:
    check_number(window_s, "fleet day", "window_s", gt=0, unit="s")
    if rates_rps.ndim != 1 or rates_rps.size == 0 or not np.all(np.isfinite(rates_rps)) or np.any(rates_rps < 0):
        raise InputError("fleet day", "rates_rps", "expected a non-empty 1-D array of finite rates >= 0")
    missing = sorted({i.template for i in plan.instances} - set(curves))
    if missing:
        raise InputError("fleet day", "curves", f"no attainment curve for template(s) {missing}")


def _late_share(backlog: float, arriving: float, served: float, limit: float) -> float:
    """Share of a window's arrivals that find more than ``limit`` requests queued ahead of them (they wait past
    the TTFT SLO), with ``backlog`` queued at its start and the queue moving linearly by ``arriving - served``
    over the window (requests)."""
    slope = arriving - served
    if slope == 0:
        return 1.0 if backlog > limit else 0.0
    edge = (limit - backlog) / slope             # the window fraction where the queue crosses the limit
    return float(np.clip(1.0 - edge, 0.0, 1.0) if slope > 0 else np.clip(edge, 0.0, 1.0))


def simulate_fleet_day(plan: FleetPlan, curves: Mapping[int, AttainmentCurve], rates_rps: Sequence[float] | np.ndarray,
                       *, window_s: float = 60.0, static_instances: int | None = None,
                       scaler_config: FleetScalerConfig | None = None, forecast: ForecastFn | None = None,
                       settings: FleetSettings | None = None) -> FleetDayResult:
    """Play ``rates_rps`` (one rate per window, req/s) on ``plan``'s instances (module docstring).

    Args:
        curves: attainment curve per template index (:attr:`FleetPlan.templates`).
        settings: the SLO and attainment the curves were measured for (their TTFT SLO bounds a backlog's
            wait; the attainment sets each curve's saturation); default :class:`FleetSettings`'s.
        static_instances: serve with the first ``n`` instances all day (ready from the start); else
            the :class:`FleetScaler` with ``scaler_config`` decides (starting with the instances the
            first window's rate needs, ready) and ``forecast`` is its look-ahead.

    Raises:
        InputError: bad window, rates, a missing curve, or ``static_instances`` outside 1..instances.
    """
    started = time.perf_counter()
    rates = np.asarray(rates_rps, dtype=float)
    _check(plan, curves, rates, window_s)
    n_all = len(plan.instances)
    rps_max = np.array([i.rps_max for i in plan.instances])
    devices = np.array([i.num_devices for i in plan.instances], dtype=float)
    template = np.array([i.template for i in plan.instances])
    k = rates.size
    held_from = np.full(n_all, np.inf)   # seconds; an instance holds devices over [held_from, held_to)
    held_to = np.full(n_all, np.inf)
    ready_s = np.full(n_all, np.inf)     # admits over [ready_s, stop_s)
    stop_s = np.full(n_all, np.inf)
    decisions: list[FleetDecision] = []
    if static_instances is not None:
        check_number(static_instances, "fleet day", "static_instances", integer=True, ge=1, le=n_all)
        held_from[:static_instances] = ready_s[:static_instances] = 0.0
        policy = f"static-{static_instances}"
        scaler = None
    else:
        scaler = FleetScaler(plan, scaler_config)
        state = scaler.initial_state(float(rates[0]))
        held_from[:state.instances] = ready_s[:state.instances] = 0.0
        policy = "dynamic"
        cfg = scaler.config
    settings = settings or FleetSettings()
    slo_ttft_s = settings.slo_ttft_ms / 1000.0
    saturation = np.zeros(max(curves) + 1 if curves else 0)
    for t_index, curve in curves.items():
        saturation[t_index] = curve.saturation_fraction(settings.attainment)
    backlog = 0.0                    # requests queued beyond what the instances serve in time
    used_templates = sorted({int(t) for t in template})
    att_by_template = np.zeros(saturation.size)
    admitting = np.zeros(k, dtype=int)
    held = np.zeros(k)
    attained = np.ones(k)
    load_sum = np.zeros(n_all)       # sum of load fractions over windows admitting
    served = np.zeros(n_all)         # requests routed
    windows_on = np.zeros(n_all)
    for w in range(k):
        t0 = w * window_s
        if scaler is not None and w > 0:
            state, d = scaler.decide(state, t0, float(rates[w - 1]), forecast, queued=backlog)
            if d.changed:
                decisions.append(d)
                if d.to_instances > d.from_instances:
                    new = np.arange(d.from_instances, d.to_instances)
                    # an instance draining (stopped, devices still held) is taken back at once
                    back = new[(stop_s[new] <= t0) & (held_to[new] > t0)]
                    stop_s[back] = held_to[back] = np.inf
                    cold = new[~np.isin(new, back)]
                    held_from[cold], ready_s[cold] = t0, t0 + cfg.instance_warmup_s
                    held_to[cold] = stop_s[cold] = np.inf
                else:
                    gone = np.arange(d.to_instances, d.from_instances)
                    stop_s[gone] = t0
                    held_to[gone] = t0 + cfg.instance_drain_s
        t1 = t0 + window_s
        # share of the window each instance admits / holds (changes land on window edges, warm-ups may not)
        admit_share = np.clip((np.minimum(stop_s, t1) - np.maximum(ready_s, t0)) / window_s, 0.0, 1.0)
        hold_share = np.clip((np.minimum(held_to, t1) - np.maximum(held_from, t0)) / window_s, 0.0, 1.0)
        held[w] = float(np.sum(hold_share * devices))
        cap = float(np.sum(admit_share * rps_max))
        admitting[w] = int(np.sum(admit_share > 0))
        arriving = rates[w] * window_s
        if cap <= 0:
            backlog += arriving
            attained[w] = 0.0 if arriving > 0 else 1.0
            continue
        on = admit_share > 0
        sat = float(np.sum(admit_share[on] * rps_max[on] * saturation[template[on]]))
        late = _late_share(backlog, arriving, sat * window_s, slo_ttft_s * sat)
        backlog = max(0.0, backlog + arriving - sat * window_s)
        if arriving <= 0:
            continue
        rho = rates[w] / cap
        weight = admit_share[on] * rps_max[on] / cap                # share of the window's requests
        for t in used_templates:  # one curve read per shape, not per instance
            att_by_template[t] = float(curves[t].at(min(rho, saturation[t])))
        attained[w] = (1.0 - late) * float(np.sum(weight * att_by_template[template[on]]))
        load_sum[on] += rho * admit_share[on]
        windows_on[on] += admit_share[on]
        served[on] += weight * rates[w] * window_s
    used = np.flatnonzero(np.isfinite(held_from))
    rows = []
    for i in used:
        lo, hi = held_from[i], min(held_to[i], k * window_s)
        rows.append({"instance_id": plan.instances[i].instance_id, "devices": int(devices[i]),
                     "device_hours": float(devices[i] * max(0.0, hi - lo) / 3600.0),
                     "mean_load_fraction": float(load_sum[i] / windows_on[i]) if windows_on[i] > 0 else 0.0,
                     "requests": float(served[i])})
    return FleetDayResult(policy=policy, window_s=window_s, offered_rps=rates, admitting=admitting, held_devices=held,
                          attainment=attained, instances=pd.DataFrame(rows), decisions=tuple(decisions),
                          wall_s=time.perf_counter() - started)


def best_static(plan: FleetPlan, curves: Mapping[int, AttainmentCurve], rates_rps: Sequence[float] | np.ndarray, *,
                attainment: float, window_s: float = 60.0, settings: FleetSettings | None = None) -> FleetDayResult:
    """The static fleet gear with the fewest instances whose day attainment is at least ``attainment``
    (bisection over the nested prefixes; the whole fleet when none reaches it)."""
    lo, hi = 1, len(plan.instances)
    best = simulate_fleet_day(plan, curves, rates_rps, window_s=window_s, static_instances=hi, settings=settings)
    while lo < hi:
        mid = (lo + hi) // 2
        r = simulate_fleet_day(plan, curves, rates_rps, window_s=window_s, static_instances=mid, settings=settings)
        if r.slo_attainment >= attainment:
            best, hi = r, mid
        else:
            lo = mid + 1
    return best


#: Two day attainments this close are equal (0.1 point): the static fleet gear a day is compared with is
#: the fewest instances whose attainment is within it of the dynamic one's.
EQUAL_ATTAINMENT = 0.001


@dataclass(frozen=True)
class DayComparison:
    """One tide day on a fleet: the scaler's policy and the best static fleet gear at equal attainment.

    Attributes:
        peak_rps: the day's peak, req/s. rates_rps: the day's rate per window, req/s.
        dynamic / static: the two policies' days.
        bound_device_hours: no policy holds fewer: the fewest instances each window at 100 % of their
            envelopes, started and stopped instantly, device-hours.
    """

    peak_rps: float
    rates_rps: np.ndarray
    dynamic: FleetDayResult
    static: FleetDayResult
    bound_device_hours: float = math.nan

    @property
    def device_hours_ratio(self) -> float:
        """Dynamic device-hours / the best static's (the bench goal: <= 0.6)."""
        return self.dynamic.device_hours / self.static.device_hours if self.static.device_hours > 0 else math.nan

    @property
    def bound_ratio(self) -> float:
        """:attr:`bound_device_hours` / the best static's: a goal on :attr:`device_hours_ratio` below it is
        out of any policy's reach."""
        return self.bound_device_hours / self.static.device_hours if self.static.device_hours > 0 else math.nan


def bound_device_hours(plan: FleetPlan, rates_rps: Sequence[float] | np.ndarray, window_s: float = 60.0,
                       headroom_fraction: float = 0.0) -> float:
    """Device-hours of the fewest nested instances holding each window's rate at 100 % of their envelopes
    (``headroom_fraction`` 0), started and stopped instantly (no warm-up or drain): a floor under every
    policy's. With ``headroom_fraction`` > 0, the floor under a policy that keeps that headroom (the fleet
    scaler's 10 %: what perfect tracking at that headroom holds)."""
    prefix_devices = np.concatenate([[0], np.cumsum([i.num_devices for i in plan.instances])])
    held = sum(prefix_devices[plan.instances_for(float(r), headroom_fraction)]
               for r in np.asarray(rates_rps, dtype=float))
    return float(held) * window_s / 3600.0


def compare_day(plan: FleetPlan, curves: Mapping[int, AttainmentCurve], start_day: int, *, peak_rps: float,
                settings: FleetSettings | None = None, scaler_config: FleetScalerConfig | None = None) -> DayComparison:
    """Day ``start_day`` of the tide (:func:`tide_rates`, peak ``peak_rps``) under the fleet scaler, with the
    leave-one-out tide forecast (the other days' profile), against :func:`best_static` at equal attainment
    (within :data:`EQUAL_ATTAINMENT`).

    Raises:
        InputError: as :func:`tide_rates` and :func:`simulate_fleet_day`.
    """
    rates = tide_rates(start_day, peak_rps=peak_rps)
    dynamic = simulate_fleet_day(plan, curves, rates, scaler_config=scaler_config, settings=settings,
                                 forecast=leave_one_out_forecast(start_day, 86400.0))
    static = best_static(plan, curves, rates, attainment=dynamic.slo_attainment - EQUAL_ATTAINMENT, settings=settings)
    return DayComparison(peak_rps=peak_rps, rates_rps=rates, dynamic=dynamic, static=static,
                         bound_device_hours=bound_device_hours(plan, rates))


def instance_changes(plan: FleetPlan, day: FleetDayResult, *, warmup_s: float) -> list[InstanceChange]:
    """The adds and removes ``day`` decided, as :class:`~flexpipe_dag.sim.fleet.InstanceChange` s for the exact
    fleet simulator (the first window's instances added ready at 0; an instance added again after a
    removal gets the id ``<instance_id>#<k>``)."""
    changes: list[InstanceChange] = []
    live: dict[int, str] = {}
    uses: dict[int, int] = {}

    def add(i: int, t_s: float, ready_in_s: float) -> None:
        inst = plan.instances[i]
        uses[i] = uses.get(i, 0) + 1
        live[i] = inst.instance_id if uses[i] == 1 else f"{inst.instance_id}#{uses[i]}"
        changes.append(InstanceChange(at_s=t_s, kind="add", instance_id=live[i], gear=inst.gear,
                                      timing=plan.templates[inst.template].timing, ready_in_s=ready_in_s,
                                      rps_max=inst.rps_max))

    for i in range(int(day.admitting[0])):
        add(i, 0.0, 0.0)
    for d in day.decisions:
        if d.to_instances > d.from_instances:
            for i in range(d.from_instances, d.to_instances):
                add(i, d.t_s, warmup_s)
        else:
            for i in range(d.to_instances, d.from_instances):
                changes.append(InstanceChange(at_s=d.t_s, kind="remove", instance_id=live.pop(i)))
    return changes


def tide_rates(start_day: int, *, peak_rps: float, window_s: float = 60.0) -> np.ndarray:
    """Day ``start_day`` of the bundled ServeGen tide on ``window_s`` steps, scaled so its peak is ``peak_rps``:
    one rate per window, req/s, shape ``(86400 / window_s,)``.

    ServeGen gives the mean rate of each 600-s window; a step of the sum at a window's edge is an artifact
    of that averaging, not traffic (it would jump +70 % in one instant). The rate at a time is read
    linearly between the windows' midpoints (the neighbouring days' windows at the day's ends), which
    keeps each window's mean within the interpolation's error and the day's shape.

    Raises:
        InputError: a day outside the tide, ``peak_rps`` or ``window_s`` not > 0.
    """
    tide = load_tide_trace()
    days = int(tide.duration_s // 86400)
    check_number(start_day, "fleet day", "start_day", integer=True, ge=0, le=days - 1, unit="a day of the ServeGen tide")
    check_number(peak_rps, "fleet day", "peak_rps", gt=0, unit="req/s")
    check_number(window_s, "fleet day", "window_s", gt=0, unit="s")
    start = 86400.0 * start_day
    t = start + np.arange(0.0, 86400.0, window_s) + window_s / 2.0
    centers = start + np.arange(-tide.window_s, 86400.0 + tide.window_s, tide.window_s) + tide.window_s / 2.0
    rates = np.interp(t, centers, np.asarray(tide.rate_at(centers), dtype=float))
    top = float(rates.max())
    if top <= 0:
        raise InputError("fleet day", "start_day", f"day {start_day} of the tide carries no traffic")
    out: np.ndarray = rates * (peak_rps / top)
    return out
