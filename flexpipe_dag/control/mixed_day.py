"""The mixed day: a day of online tide plus an offline backlog on one fleet, under three policies.

Online requests (a trace time-warped to a day of the tide, compressed) are served by the operating
gears; offline jobs (a backlog, e.g. arXiv summarisation lengths) run on the devices online does not
hold, one planned pipeline instance per set of free devices (:mod:`flexpipe_dag.control.offline_fill`:
planner on the free devices, simulator for the work, weight load on every new instance, unfinished
jobs put back on every change). The policies:

* **static**: the gear that holds the peak (the most requests within SLO in its static run) serves
  the whole day; offline runs on the devices it does not use, all day.
* **dynamic**: the gear-shift controller (:func:`~flexpipe_dag.control.replay.run_dynamic`, the tide
  replay's figures and forecast plus :data:`MIXED_DAY_CONTROLLER`: a shift down goes to the gear on
  the fewest devices that holds the load, its recent peak and the forecast with headroom) moves
  online between gears; offline runs on the devices each gear frees, so it is admitted in troughs
  (a shift down frees devices) and preempted on rises (a shift up takes them back: the instance
  stops, its unfinished jobs return to the backlog). During a shift's warm-up and drain both gears'
  devices are held by online. Offline work also fills the serving gear's spare capacity in troughs,
  as the live serve loop does (:mod:`flexpipe_dag.control.offline_share`: admitted below half the
  gear's ``rps_max``, paused above three quarters, at most 1/16 of its seats shrinking as online load
  nears the pause level, nothing new while online P99s are above half the SLO, online first, offline
  evicted first when online needs KV blocks); ``share=None`` turns that off.
* **oracle**: per window, the gear on the fewest devices whose static run met the SLO for >=
  :data:`~flexpipe_dag.control.replay.ATTAINMENT` of that window's requests, with free and instant
  shifts and free offline restarts: the bound on reservation. Its gears share their spare capacity
  by the same rule (a replay of its picks), so its offline figure bounds the dynamic one's too.

The static policy lends only the devices its gear does not use (the issue's baseline: no controller,
no tide rule); the devices online holds are counted as reserved whether or not offline work shares
them, so sharing raises offline work, never lowers the reservation.

Reported per policy: online SLO attainment, requests lost, offline tokens completed (prompt + output
of finished jobs) and jobs, offline lost and duplicated (0), the reservation curve (mean devices
online holds in each hour of the day: device-hours per hour), its mean against the static policy's,
and shifts per hour (of the replay's clock).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from flexpipe_dag.control.config import ControllerConfig
from flexpipe_dag.control.controller import Controller, ForecastFn
from flexpipe_dag.control.offline_fill import OfflineBacklog, OfflinePlanner, OfflineRun, run_offline
from flexpipe_dag.control.offline_share import (
    DEFAULT_GUARD_FRACTION,
    DEFAULT_SEATS_FRACTION,
    OfflineShare,
    ShareOutcome,
)
from flexpipe_dag.control.replay import (
    arrivals_per_window,
    cheapest_holding_gear,
    lost_count,
    online_outcome,
    opening_gear,
    replay_controller_config,
    run_dynamic,
    run_static,
    slo_met_per_window,
)
from flexpipe_dag.control.tide import TideConfig
from flexpipe_dag.core.cluster import ClusterProfile
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.timing import StageTimingModel
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.sim import SimConfig, Simulator
from flexpipe_dag.sim.device_hours import DeviceSpan, device_usage
from flexpipe_dag.sim.results import SimResult
from flexpipe_dag.workload.request import Workload

POLICIES = ("static", "dynamic", "oracle")
#: Controller figures the mixed day sets beyond the tide replays' (:data:`~flexpipe_dag.control.replay.REPLAY_CONTROLLER`),
#: with what each does: the fleet lends what online does not hold to offline work, so the controller hands
#: devices back once the load allows.
MIXED_DAY_CONTROLLER: dict[str, tuple[float, str]] = {
    "downshift_headroom_fraction": (0.2, "shift to the gear on the fewest devices that holds the load, its recent "
                                         "peak and the forecast with 20 % headroom (seed 0 = off)"),
    "upshift_headroom_fraction": (0.1, "leave a gear when the load or its forecast passes 90 % of its envelope, not "
                                       "105 %: an envelope is measured at 95 % SLO attainment (seed 0 = off)"),
    "forecast_horizon_s": (300.0, "look-ahead of the load forecast, simulated s: 2 h of a day compressed into an "
                                  "hour (the tide replays' 600 s shifted up hours before rises day 0 did not have)"),
    "overload_dwell_s": (0.0, "a shift up the load over the envelope fires waits out no dwell (seed: dwell_s), as "
                              "Kubernetes' HPA scales up: on lab day 0 a shift down the load then overran (7.5 req/s on "
                              "a 6.1 req/s gear) held for the 600-s dwell, 4 hours of the compressed day, and missed "
                              "3.2 % of the requests"),
}


def mixed_day_controller_config(slo_ttft_ms: float, **overrides: float) -> ControllerConfig:
    """The dynamic policy's controller: the tide replays' (:func:`~flexpipe_dag.control.replay.replay_controller_config`)
    plus :data:`MIXED_DAY_CONTROLLER`'s figures, each overridable by name.

    Raises:
        pydantic.ValidationError: a figure out of its range, or an unknown one.
    """
    figures = {field: default for field, (default, _) in MIXED_DAY_CONTROLLER.items()} | overrides
    return replay_controller_config(slo_ttft_ms, **figures)
#: Bins of the reservation curve: the hours of the (compressed) day.
HOURS_PER_DAY = 24


def reservation_curve(spans: Sequence[DeviceSpan], duration_s: float, bins: int = HOURS_PER_DAY) -> list[float]:
    """Mean devices held in each of ``bins`` equal parts of ``[0, duration_s]`` (device-hours per hour).

    Raises:
        InputError: ``duration_s`` <= 0 or ``bins`` < 1.
    """
    if not duration_s > 0:
        raise InputError("reservation curve", "duration_s", f"got {duration_s}; expected seconds > 0")
    if bins < 1:
        raise InputError("reservation curve", "bins", f"got {bins}; expected >= 1")
    width = duration_s / bins
    held = np.zeros(bins)
    for s in spans:
        for k in range(bins):
            a, b = max(s.start_s, k * width), min(s.end_s, (k + 1) * width)
            if b > a:
                held[k] += s.num_devices * (b - a)
    return [float(v) for v in held / width]


def free_segments(spans: Sequence[DeviceSpan], fleet: frozenset[str], duration_s: float
                  ) -> list[tuple[float, float, frozenset[str]]]:
    """The devices online does not hold over ``[0, duration_s]``: ``(start_s, end_s, free ids)`` stretches."""
    cuts = sorted({0.0, float(duration_s)} | {min(max(t, 0.0), duration_s) for s in spans for t in (s.start_s, s.end_s)})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        if b <= a:
            continue
        held: frozenset[str] = frozenset()
        for s in spans:
            if s.start_s <= a and s.end_s >= b:
                held = s.device_ids
        out.append((a, b, fleet - held))
    return out


@dataclass
class PolicyResult:
    """One policy's day (module docstring for the figures)."""

    policy: str
    online_requests: int
    online_slo_met: float
    online_lost: int
    spans: list[DeviceSpan]
    curve: list[float]
    shifts: int
    offline: OfflineRun
    notes: list[str] = field(default_factory=list)

    @property
    def attainment(self) -> float:
        """Share of online requests meeting both SLOs."""
        return self.online_slo_met / self.online_requests if self.online_requests else 1.0

    @property
    def mean_devices(self) -> float:
        """Mean devices online holds over the day."""
        return float(np.mean(self.curve)) if self.curve else 0.0

    def to_dict(self, duration_s: float) -> dict[str, Any]:
        """Plain figures (JSON-ready)."""
        hours = duration_s / 3600.0
        return {"policy": self.policy, "online_requests": self.online_requests,
                "online_slo_attainment": round(self.attainment, 4), "online_lost": self.online_lost,
                "mean_online_devices": round(self.mean_devices, 3),
                "online_device_hours": round(self.mean_devices * hours, 3),
                "reservation_curve_devices": [round(v, 3) for v in self.curve],
                "shifts": self.shifts, "shifts_per_hour": round(self.shifts / hours, 3) if hours > 0 else 0.0,
                "offline_tokens": self.offline.tokens, "offline_output_tokens": self.offline.output_tokens,
                "offline_tokens_shared": self.offline.shared_tokens,
                "offline_jobs": len(self.offline.completions), "offline_preempted": self.offline.preempted,
                "offline_lost": self.offline.lost, "offline_duplicated": self.offline.duplicated,
                "offline_warmup_s": round(self.offline.warmup_s, 1), "notes": list(self.notes)}


@dataclass
class MixedDay:
    """The three policies' days and the setting they ran in."""

    duration_s: float
    fleet_devices: int
    static_gear_id: str
    policies: dict[str, PolicyResult]
    offline_instances: list[str]

    def share_of_static(self, policy: str) -> float:
        """A policy's mean online reservation as a share of the static policy's."""
        base = self.policies["static"].mean_devices
        return self.policies[policy].mean_devices / base if base > 0 else math.inf

    def offline_vs_static(self, policy: str) -> float:
        """A policy's offline tokens as a multiple of the static policy's."""
        base = self.policies["static"].offline.tokens
        mine = self.policies[policy].offline.tokens
        return mine / base if base > 0 else (math.inf if mine > 0 else 1.0)

    def to_dict(self) -> dict[str, Any]:
        """Plain figures (JSON-ready)."""
        return {"duration_s": self.duration_s, "fleet_devices": self.fleet_devices,
                "static_gear_id": self.static_gear_id, "offline_instances": list(self.offline_instances),
                "policies": {k: {**p.to_dict(self.duration_s),
                                 "reservation_share_of_static": round(self.share_of_static(k), 4),
                                 "offline_tokens_vs_static": round(self.offline_vs_static(k), 4)}
                             for k, p in self.policies.items()}}


@dataclass(frozen=True)
class DaySetting:
    """What a mixed day runs on (plain inputs; see :func:`run_mixed_day`).

    Attributes:
        workload: the online requests of the (compressed) day.
        duration_s: the day's length on the replay's clock, s.
        gears / timings: the operating gears and their stage times (by gear id).
        window_s: the oracle's window, s (one controller dwell by default).
    """

    workload: Workload
    duration_s: float
    cluster: ClusterProfile
    spec: ModelSpec
    dtype: str
    gears: Sequence[Gear]
    timings: Mapping[str, StageTimingModel]
    sim_config: SimConfig
    window_s: float = 600.0


def _offline(setting: DaySetting, spans: Sequence[DeviceSpan], planner: OfflinePlanner, backlog: OfflineBacklog,
             warmup: bool, shared: ShareOutcome | None = None) -> OfflineRun:
    """The free devices' offline run over ``spans``' complement, with the jobs ``shared`` finished in the online
    gear's spare capacity (taken from the same ``backlog``) added to its completions."""
    fleet = frozenset(d.device_id for d in setting.cluster.devices)
    run = run_offline(free_segments(spans, fleet, setting.duration_s), planner, backlog, warmup=warmup)
    if shared is not None:
        run.completions = sorted(run.completions + shared.completions, key=lambda c: c.t_s)
        run.preempted += shared.preempted
    return run


#: The sharing gate's smoothing of the online rate per 2-s sample: at ~1 req/s a sample holds ~2 arrivals, and
#: the tide sensor's 0.3 flipped admit / pause within seconds in the replays; 0.1 (about 20 s) as the controller's
#: rps_ema_alpha.
SHARE_EMA_ALPHA = 0.1


@dataclass(frozen=True)
class ShareSettings:
    """Offline work in the online gear's spare capacity (:mod:`flexpipe_dag.control.offline_share`).

    Attributes:
        tide: the serve loop's admit / pause thresholds (fractions of the serving gear's ``rps_max``),
            smoothing (default :data:`SHARE_EMA_ALPHA`) and hysteresis; its ``horizon_s`` (tide seconds) is read
            on the day's compressed clock.
        seats_fraction: share of the serving gear's seats offline work may hold at once at no online load.
        guard_fraction: share of each SLO the online P99s must stay below for new offline work.
    """

    tide: TideConfig = field(default_factory=lambda: TideConfig(ema_alpha=SHARE_EMA_ALPHA))
    seats_fraction: float = DEFAULT_SEATS_FRACTION
    guard_fraction: float = DEFAULT_GUARD_FRACTION

    def feed(self, setting: DaySetting, backlog: OfflineBacklog) -> OfflineShare:
        """The feed for one replay of ``setting``'s day (its horizon on the replay's clock)."""
        horizon_s = self.tide.horizon_s * setting.duration_s / 86400.0  # a tide day is played in duration_s
        return OfflineShare(backlog, self.tide, horizon_s=horizon_s, until_s=setting.duration_s,
                            max_context_tokens=setting.spec.max_context_tokens, seats_fraction=self.seats_fraction,
                            slo_ttft_ms=setting.sim_config.slo_ttft_ms, slo_tpot_ms=setting.sim_config.slo_tpot_ms,
                            guard_fraction=self.guard_fraction)


#: The dynamic and oracle policies' offline sharing: the serve loop's seed thresholds (admit below 50 %, pause
#: above 75 % of the serving gear's rps_max), 1/16 of the seats, the latency guard at half the SLO.
DEFAULT_SHARE = ShareSettings()


def run_scripted(setting: DaySetting, picks: Sequence[Gear], feed: OfflineShare, forecast: ForecastFn | None) -> SimResult:
    """Replay the day on the gear ``picks[k]`` in window ``k`` (shifts instant, at window starts), with ``feed``
    filling each gear's spare capacity: the oracle's offline work inside its gears."""
    sim = Simulator(setting.workload, picks[0], setting.timings[picks[0].gear_id], setting.sim_config)
    by_id = {g.gear_id: g for g in setting.gears}
    period = setting.sim_config.sample_period_s
    while not sim.finished:
        samples = sim.advance(sim.now_s + period)
        if samples:
            feed.step(sim, samples[-1], by_id[sim.gear_id], forecast)
        k = int(sim.now_s // setting.window_s)
        if k < len(picks) and picks[k].gear_id != sim.gear_id:
            sim.shift_gear(picks[k], setting.timings[picks[k].gear_id])
    return sim.result()


def run_mixed_day(setting: DaySetting, controller: Controller, offline_jobs: Workload, *, cycle_backlog: bool = True,
                  forecast: ForecastFn | None = None, load_gbps: float | None = None,
                  share: ShareSettings | None = DEFAULT_SHARE) -> MixedDay:
    """Run the static, dynamic and oracle policies over one mixed day (module docstring).

    Args:
        controller: the gear-shift controller of the dynamic policy.
        offline_jobs: the offline backlog (its lengths; arrival times are ignored: all are queued).
        cycle_backlog: repeat the backlog without end (a backlog that outlasts the day).
        forecast: the controller's load forecast, or None.
        load_gbps: host-to-device weight load bandwidth of offline instances, GB/s (default
            :data:`~flexpipe_dag.control.offline_fill.DEFAULT_LOAD_GBPS`).
        share: offline work in the online gears' spare capacity (dynamic and oracle policies; default
            :data:`DEFAULT_SHARE`, the serve loop's seed thresholds), or None for none: offline only on the
            devices online does not hold.

    Raises:
        InputError: no gears, a gear without stage times, ``duration_s`` or ``window_s`` <= 0.
    """
    gears, duration_s = list(setting.gears), float(setting.duration_s)
    if not gears:
        raise InputError("mixed day", "gears", "expected at least one operating gear")
    missing = [g.gear_id for g in gears if g.gear_id not in setting.timings]
    if missing:
        raise InputError("mixed day", "timings", f"no stage times for gears {missing}")
    for name in ("duration_s", "window_s"):
        if not getattr(setting, name) > 0:
            raise InputError("mixed day", name, f"got {getattr(setting, name)}; expected seconds > 0")
    planner_kw = {} if load_gbps is None else {"load_gbps": load_gbps}
    planner = OfflinePlanner(setting.cluster, setting.spec, offline_jobs, dtype=setting.dtype, **planner_kw)
    devices_by_gear = {g.gear_id: g.device_ids for g in gears}
    n_win = max(1, math.ceil(duration_s / setting.window_s))
    n_req = len(setting.workload)

    graded = replace(setting.sim_config, metric_samples=False)  # static runs are graded per request: no samples
    static_runs = {g.gear_id: run_static(setting.workload, g, setting.timings[g.gear_id], graded) for g in gears}
    per_window = {gid: slo_met_per_window(res, setting.window_s, n_win) for gid, res in static_runs.items()}
    static_gear = max(gears, key=lambda g: (float(per_window[g.gear_id].sum()), -len(g.device_ids)))
    policies: dict[str, PolicyResult] = {}

    # (a) static: the peak gear all day
    def backlog() -> OfflineBacklog:
        return OfflineBacklog(offline_jobs.requests, cycle=cycle_backlog)

    res = static_runs[static_gear.gear_id]
    spans = list(device_usage(static_gear.gear_id, [], devices_by_gear, end_s=duration_s).spans)
    policies["static"] = PolicyResult("static", n_req, float(res.requests["slo_met"].sum()), lost_count(res.summary),
                                      spans, reservation_curve(spans, duration_s), 0,
                                      _offline(setting, spans, planner, backlog(), True),
                                      [f"gear {static_gear.gear_id} ({len(static_gear.device_ids)} devices)"])

    # (b) dynamic: the controller shifts; offline fills what each gear frees, and its spare capacity in troughs
    out_mean = sum(r.output_tokens for r in setting.workload.requests) / max(1, n_req)
    start = opening_gear(setting.workload, gears)
    jobs = backlog()
    feed = share.feed(setting, jobs) if share is not None else None
    dyn, taken = run_dynamic(setting.workload, gears, setting.timings, start, setting.sim_config, controller,
                             setting.cluster, setting.spec, setting.dtype, out_mean, forecast=forecast, offline=feed,
                             decide_until_s=duration_s)
    shared = feed.settle(dyn) if feed is not None else None
    spans = list(device_usage(start.gear_id, dyn.shifts, devices_by_gear, end_s=duration_s).spans)
    met, lost = online_outcome(dyn)
    notes = [f"t={t.decision.t_s:.0f} s: {t.decision.reason}" for t in taken]
    if shared is not None:
        notes += [f"t={t:.0f} s: {why}" for t, _, why in shared.decisions]
    policies["dynamic"] = PolicyResult("dynamic", n_req, met, lost, spans, reservation_curve(spans, duration_s),
                                       len(taken), _offline(setting, spans, planner, jobs, True, shared), notes)

    # (c) oracle: per window the cheapest gear holding that window, free shifts and restarts
    arrivals = arrivals_per_window(setting.workload, setting.window_s, n_win)
    picks = [cheapest_holding_gear(gears, {gid: per_window[gid][k] for gid in per_window}, arrivals[k])
             for k in range(n_win)]
    spans = []
    for k, g in enumerate(picks):
        a, b = k * setting.window_s, min(duration_s, (k + 1) * setting.window_s)
        if b <= a:
            continue
        ids = frozenset(g.device_ids)
        if spans and spans[-1].device_ids == ids:
            spans[-1] = DeviceSpan(spans[-1].start_s, b, ids)
        else:
            spans.append(DeviceSpan(a, b, ids))
    met = sum(float(per_window[g.gear_id][k]) for k, g in enumerate(picks))
    changes = sum(1 for x, y in zip(picks, picks[1:]) if x.gear_id != y.gear_id)
    jobs = backlog()
    shared = None
    if share is not None:
        feed = share.feed(setting, jobs)
        shared = feed.settle(run_scripted(setting, picks, feed, forecast))
    policies["oracle"] = PolicyResult("oracle", n_req, met, 0, spans, reservation_curve(spans, duration_s), changes,
                                      _offline(setting, spans, planner, jobs, False, shared),
                                      ["per window: " + " ".join(g.kind[0] for g in picks)])
    return MixedDay(duration_s=duration_s, fleet_devices=len(setting.cluster.devices),
                    static_gear_id=static_gear.gear_id, policies=policies,
                    offline_instances=[f"{len(i.device_ids)} free devices: {i.note}" for i in planner.instances])


@dataclass(frozen=True)
class Goal:
    """One bar of the issue's mixed-day goal: the dynamic policy's figure against it, and whether it is met."""

    name: str
    value: float
    bar: str
    met: bool


#: The issue's bars (dynamic against static): reservation share, offline multiple, shifts per hour.
GOAL_RESERVATION_SHARE = 0.45
GOAL_OFFLINE_MULTIPLE = 1.5
GOAL_SHIFTS_PER_HOUR = 4.0


def goals(day: MixedDay, policy: str = "dynamic") -> list[Goal]:
    """The issue's goal for ``policy`` against static: online SLO attainment no lower than static's, mean
    online reservation <= 45 % of static's, offline tokens >= 1.5x static's, <= 4 shifts per hour (of the
    replay's clock), 0 lost or duplicated (online requests and offline jobs)."""
    p, s = day.policies[policy], day.policies["static"]
    per_hour = p.shifts / (day.duration_s / 3600.0)
    lost = p.online_lost + p.offline.lost + p.offline.duplicated
    return [
        Goal("online SLO attainment", p.attainment, f">= static's {s.attainment:.4f}", p.attainment >= s.attainment),
        Goal("mean online reservation / static", day.share_of_static(policy), f"<= {GOAL_RESERVATION_SHARE:.2f}",
             day.share_of_static(policy) <= GOAL_RESERVATION_SHARE),
        Goal("offline tokens / static", day.offline_vs_static(policy), f">= {GOAL_OFFLINE_MULTIPLE:.1f}x",
             day.offline_vs_static(policy) >= GOAL_OFFLINE_MULTIPLE),
        Goal("shifts per hour", per_hour, f"<= {GOAL_SHIFTS_PER_HOUR:g}", per_hour <= GOAL_SHIFTS_PER_HOUR),
        Goal("lost + duplicated", float(lost), "= 0", lost == 0),
    ]
