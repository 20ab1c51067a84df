"""Scaling a fleet gear out and in: how many instances of the plan serve, decided sample by sample.

Pure and deterministic, like :class:`~flexpipe_dag.control.controller.Controller`: :meth:`FleetScaler.decide`
takes the previous :class:`FleetScalerState` and one observed request rate and returns the next state
and a :class:`FleetDecision`. Fleet gears are nested prefixes of :attr:`FleetPlan.instances
<flexpipe_dag.planner.fleet.FleetPlan.instances>`, so a decision is a target instance count ``n``:
scaling out starts instances ``n..n'`` (each warms up before it admits); scaling in stops admitting on
the last ones, which drain and then give their devices back.

Per sample, on the request rate smoothed with Holt's linear trend (a level, ``rps_ema_alpha``, and a
rise per second, ``trend_beta``) and, when one is given, the forecast (the highest load expected
within a look-ahead, as the gear-shift controller's). The **load** a decision sizes for is the level
plus a rising trend x (``instance_warmup_s`` + ``sample_period_s``): the rate expected when instances
ordered now start to serve, until the next look (a falling trend is not extrapolated, so a scale-in
never sizes below the observed level). With ``sizing_lead_s`` > 0 the forecast within that look-ahead
is a floor of the load (default 0; see below).

* **scale out** (``rps_above_envelope``): when the load exceeds the serving instances' summed envelope
  x (1 - ``headroom_fraction``) for ``scale_out_samples`` (default 1) samples, to the fewest instances
  that hold it with that headroom. Instances still warming up count as serving, so a higher target
  means more is needed and no dwell separates two scale-outs (``scale_out_dwell_s`` default 0). A
  scale-out the smoothed load asks for is sized for the latest sample's rate (plus the same rise) when that
  is higher: on a ramp's onset the smoothing lags by a sample or two, and each lag is a warm-up late (a
  sample alone never triggers one, so a noisy sample cannot order instances). A load
  above the envelope must be followed, so there is no payback test (as the controller's
  ``rps_above_envelope``). An **overload** (the raw, unsmoothed rate above the whole envelope for
  ``overload_samples``, default 1) scales out at once, to the instances the raw rate needs: traffic
  that returns after a lull (or an outage) would otherwise queue for the smoothing's lag before the
  warm-up even starts. Requests already **queued** beyond what the instances serve in time (the
  caller's measure) add ``queued / backlog_drain_s`` to the load, so a surge's backlog is drained by
  added instances, not by the few percent of headroom alone.
* **scale in** (``fewer_instances_hold``, discretionary): when fewer instances hold the load with the
  wider ``scale_in_headroom_fraction`` for ``hysteresis_samples`` samples, outside the dwell
  (``dwell_s`` after any change), and the move pays back: the smaller gear is expected to hold for
  ``R`` seconds (the forecast's, looked up in steps of ``sample_period_s`` up to
  ``forecast_horizon_s``; without a forecast, one dwell), and its freed devices x ``R`` must exceed the
  devices x (warm-up + drain) it costs to bring them back: ``R > payback_factor x
  (instance_warmup_s + instance_drain_s)``. The band between the two headrooms says *when* to scale
  in (the hysteresis); a scale-in *lands* in the middle of that band (the fewest instances holding the
  load with headroom ``(headroom_fraction + scale_in_headroom_fraction) / 2``), so a load that moves
  by less than half the band either way triggers neither rule. One scale-in gives back at most
  ``scale_in_max_fraction`` of the serving envelope (default a third,
  :data:`DEFAULT_SCALE_IN_MAX_FRACTION`): a rate that vanishes faster than a tide falls is an outage,
  and the traffic comes back at its level; the rest is given back a dwell later if the load stays low.
* **outage** (``outage``): while the raw or the smoothed rate is under ``outage_fraction`` (10 %) of the
  serving envelope, the traffic has vanished rather than fallen (a tide the scaler follows down stays above
  about half of it), and scale-ins wait, up to ``outage_hold_s`` (2 hours) from the outage's start; they count
  their ``hysteresis_samples`` afresh once it ends. A return at the day's level then finds its instances warm
  (each instance given back a third per dwell before was a cold start: a warm-up of queue and missed requests
  on a return that comes back within minutes); a return at a lower level is scaled in to as any load, and an
  outage longer than the hold is given back a third per dwell.

Why these rules (``bench/fleet_scale.py --only day --days all``, the 14 ServeGen tide days, on
``examples/clusters/fleet_1k.yaml`` with Llama-3-8B and on ``bench/fleets/fleet_h100_mix.yaml`` with
Qwen2.5-7B): an instance's envelope is where its SLO attainment falls off a cliff (a probe long enough
for the rate shows it: 0.99 at the envelope, 0.16 at 1.15x for an A100 host), and a tide day ramps by
up to 6 % a minute. Sized for the smoothed rate after two samples, with 120 s between scale-outs,
the fleet ran a warm-up behind every steep ramp and the queue made whole minutes miss (day
attainment 0.84-0.94 on four days of fleet_1k). The trend and one-sample scale-out keep it at
>= 0.98 on every day of both fleets (at the default 10 % headroom). A seasonal forecast read for
sizing looks a whole profile window (600 s) ahead at that window's coarse level: it held more
device-hours without better attainment than the trend, which follows each day's own ramp, so it
guards scale-in (payback) only unless ``sizing_lead_s`` is set. The outage hold raised the attainment of
the outage days (fleet_1k days 10 and 12: 0.9939 -> 0.9987 and 0.9965 -> 0.9992; fleet_h100_mix days 10, 12
and 13: 0.9949-0.9975 -> 0.9997-0.9999) for 0.4-1.7 % more device-hours (the other days are unchanged). Landing a scale-in at the band's
lower edge (the first version) kept a falling tide's fleet at the edge's load at best, where a
plan's last instances are its least efficient per device.

Every decision carries a one-sentence reason with the figures and a ``reason_kind``
(``scale_out``, ``scale_in``, ``hold``, ``dwell``, ``payback``, ``outage``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import Field, model_validator

from flexpipe_dag.control.config import DAY_S, MAX_FIGURE, Figures
from flexpipe_dag.control.controller import ForecastFn, read_forecast
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.settings import INT64_MAX, check_number
from flexpipe_dag.planner.fleet import DEFAULT_HEADROOM_FRACTION, FleetPlan

#: Below 1 - this share of the envelope the scaler gives instances back (the band above it, up to
#: 1 - :data:`~flexpipe_dag.planner.fleet.DEFAULT_HEADROOM_FRACTION`, is the hysteresis).
DEFAULT_SCALE_IN_HEADROOM_FRACTION = DEFAULT_HEADROOM_FRACTION + 0.10

#: A scale-in keeps at least 1 - this share of the serving envelope (as Kubernetes' HPA scale-down policies
#: cap the pods removed per period). On the 14 ServeGen tide days the steepest fall within a dwell (600 s)
#: outside an outage is 38 %, so a third seldom binds on a tide; six of the days have outages (the rate drops
#: to 0 for 10-90 minutes, then returns at the day's level in minutes), where giving everything back made the
#: return a cold start: a third per dwell raised those days' attainment by 0.2-0.5 points at about the same
#: device-hours (``bench/fleet_scale.py``, both fleets).
DEFAULT_SCALE_IN_MAX_FRACTION = 1.0 / 3.0

#: A rate (raw or smoothed) below this share of the serving instances' summed envelope is an **outage**: the traffic vanished
#: faster than any tide falls (a tide's steepest fall within a dwell is 38 %, and the scaler follows it down, so a
#: tide keeps the rate above about half the envelope), and it comes back at its level when the cause is fixed.
DEFAULT_OUTAGE_FRACTION = 0.10

#: How long an outage holds the instances serving when it began (scale-ins wait), s: incidents that take
#: traffic away for minutes to an hour or two (the ServeGen tide's six outages last 10-90 minutes) come back to
#: a fleet that still holds them; a longer one is given back a third per dwell as before.
DEFAULT_OUTAGE_HOLD_S = 7200.0

#: The longest outage hold, s (``outage_hold_s`` and ``flexpipe serve --scale-outage-hold-s``): a day, the
#: tide's period; traffic gone longer than that is not an incident it returns from at its level.
MAX_OUTAGE_HOLD_S = DAY_S

#: The longest dwell after a change, s (``dwell_s`` and ``flexpipe serve --scale-dwell-s``): a day.
MAX_DWELL_S = DAY_S

FleetReasonKind = Literal["scale_out", "scale_in", "hold", "dwell", "payback", "outage"]


class FleetScalerConfig(Figures):
    """Figures of :class:`FleetScaler` (units in the names; module docstring for what each does).

    Defaults: an instance's envelope is the edge of its attainment cliff, so the fleet plans to use 90 %
    of its summed envelope (``headroom_fraction`` 0.10,
    :data:`~flexpipe_dag.planner.fleet.DEFAULT_HEADROOM_FRACTION`) and gives instances back only below
    80 % (the band is the hysteresis; a scale-in lands in its middle, 85 %); the payback test reads the forecast 600 s ahead, the
    warm-up (120 s) plus two samples and a margin; sizing follows the observed level and trend
    (``trend_beta`` 0.5: on fleet_1k's worst tide day 0.3 gave attainment 0.95 and 0.2 gave 0.93, against
    0.97), not the forecast (``sizing_lead_s`` 0).

    Numbers are strict (:class:`~flexpipe_dag.control.config.Figures`).

    Raises:
        pydantic.ValidationError: a figure of the wrong type or out of range, naming it.
    """

    sample_period_s: float = Field(60.0, gt=0, le=86400.0, allow_inf_nan=False)
    rps_ema_alpha: float = Field(0.5, gt=0, le=1, allow_inf_nan=False)
    headroom_fraction: float = Field(DEFAULT_HEADROOM_FRACTION, ge=0, lt=1, allow_inf_nan=False)
    scale_in_headroom_fraction: float = Field(DEFAULT_SCALE_IN_HEADROOM_FRACTION, ge=0, lt=1, allow_inf_nan=False)
    hysteresis_samples: int = Field(2, ge=1, le=1000, description="samples fewer instances must hold the load "
                                                                   "before a scale-in")
    scale_out_samples: int = Field(1, ge=1, le=1000, description="samples the load must be above the envelope x "
                                                                 "(1 - headroom) before a scale-out")
    trend_beta: float = Field(0.5, ge=0, le=1, allow_inf_nan=False,
                              description="smoothing of the load's trend (Holt's beta; 0: no trend, size for the level)")
    overload_samples: int = Field(1, ge=1, le=1000, description="samples a raw rate above the whole envelope needs to "
                                                                "scale out (an overload is not noise to smooth away)")
    dwell_s: float = Field(600.0, ge=0, le=MAX_DWELL_S, allow_inf_nan=False)
    scale_out_dwell_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                                     description="least time between two scale-outs (instances warming up are already "
                                                 "counted as serving, so none is needed to avoid ordering twice)")
    forecast_horizon_s: float = Field(600.0, ge=0, le=86400.0, allow_inf_nan=False,
                                      description="how far the payback test reads the forecast ahead")
    sizing_lead_s: float = Field(0.0, ge=0, le=86400.0, allow_inf_nan=False,
                                 description="scale out / in for the forecast's highest load within this look-ahead "
                                             "(0: for the observed, smoothed load)")
    instance_warmup_s: float = Field(120.0, ge=0, allow_inf_nan=False,
                                     description="start to first admission of a new instance (weights loaded, warmed)")
    instance_drain_s: float = Field(60.0, ge=0, allow_inf_nan=False,
                                    description="last admission to devices freed of a removed instance")
    payback_factor: float = Field(1.0, ge=0, allow_inf_nan=False)
    backlog_drain_s: float = Field(300.0, gt=0, allow_inf_nan=False,
                                   description="a queue is sized to drain in about this long (its rate is added to the load)")
    outage_fraction: float = Field(DEFAULT_OUTAGE_FRACTION, ge=0, lt=1, allow_inf_nan=False,
                                   description="a rate (raw or smoothed) below this share of the serving envelope "
                                               "is an outage (0: never)")
    outage_hold_s: float = Field(DEFAULT_OUTAGE_HOLD_S, ge=0, le=MAX_OUTAGE_HOLD_S, allow_inf_nan=False,
                                 description="how long an outage holds the instances serving when it began, s "
                                             "(scale-ins wait; 0: no hold)")
    scale_in_max_fraction: float = Field(DEFAULT_SCALE_IN_MAX_FRACTION, gt=0, le=1, allow_inf_nan=False,
                                         description="most of the serving envelope one scale-in gives back (1: no "
                                                     "limit): traffic that vanishes faster than a tide falls is an "
                                                     "outage, and it comes back")

    @property
    def scale_in_cost_s(self) -> float:
        """Seconds a scale-in must be expected to hold to pay back: ``payback_factor x (instance_warmup_s +
        instance_drain_s)`` (module docstring)."""
        return self.payback_factor * (self.instance_warmup_s + self.instance_drain_s)

    @model_validator(mode="after")
    def _band(self) -> FleetScalerConfig:
        if self.scale_in_headroom_fraction < self.headroom_fraction:
            raise ValueError(f"scale_in_headroom_fraction {self.scale_in_headroom_fraction} is below headroom_fraction "
                             f"{self.headroom_fraction}; expected >= (the band between them is the hysteresis)")
        return self


@dataclass(frozen=True)
class FleetScalerState:
    """What the scaler carries between samples (JSON-able plain figures).

    Attributes:
        instances: instances serving (the fleet gear ``fleet-<instances>``).
        ema_rps: smoothed request rate (Holt's level), req/s (None before the first sample).
        trend_rps_per_s: smoothed change of the rate (Holt's trend), req/s per second.
        last_sample_s: when the last sample was taken (None before the first).
        out_count / in_count: consecutive samples the scale-out / scale-in condition held.
        over_count: consecutive samples the raw rate was above the whole envelope.
        last_change_s / last_out_s: when the last change / scale-out was decided (-inf: never).
        outage_since_s: when the rate (raw or smoothed) fell below ``outage_fraction`` of the envelope (None:
            no outage now).

    Raises:
        InputError: a count (``instances``, ``*_count``) not an integer >= 0 (a boolean is refused),
            ``ema_rps`` negative or not finite, ``trend_rps_per_s`` or a time not finite (the trend may be
            negative; ``last_change_s`` / ``last_out_s`` may be -inf, never); the field is named.
    """

    instances: int
    ema_rps: float | None = None
    out_count: int = 0
    in_count: int = 0
    over_count: int = 0
    last_change_s: float = -math.inf
    last_out_s: float = -math.inf
    trend_rps_per_s: float = 0.0
    last_sample_s: float | None = None
    outage_since_s: float | None = None

    def __post_init__(self) -> None:
        # Every decide makes one or two states (a day plays thousands): plain int / float values pass on a few
        # comparisons (about 1 us), and only a state that fails them is checked field by field for the message.
        ema, last, since = self.ema_rps, self.last_sample_s, self.outage_since_s
        change, out = self.last_change_s, self.last_out_s
        if not (_is_count(self.instances) and _is_count(self.out_count) and _is_count(self.in_count)
                and _is_count(self.over_count) and (ema is None or (_is_finite(ema) and ema >= 0))
                and _is_finite(self.trend_rps_per_s) and (last is None or _is_finite(last))
                and (since is None or _is_finite(since)) and _is_time_or_never(change)
                and _is_time_or_never(out)):
            _check_state(self)


#: The number types :meth:`FleetScalerState.__post_init__` passes on comparisons alone (``type`` is
#: matched exactly: a ``bool`` is no number here; others, numpy's, are checked by :func:`_check_state`).
_PLAIN = (int, float)


def _is_count(value: object) -> bool:
    """Whether ``value`` is a plain ``int`` in 0..:data:`~flexpipe_dag.core.settings.INT64_MAX` (not a ``bool``)."""
    return type(value) is int and 0 <= value <= INT64_MAX


def _is_finite(value: object) -> bool:
    """Whether ``value`` is a plain ``int`` or ``float`` and finite (not a ``bool``, not NaN)."""
    return type(value) in _PLAIN and -math.inf < value < math.inf  # type: ignore[operator]


def _is_time_or_never(value: object) -> bool:
    """Whether ``value`` is a plain ``int`` or ``float``, finite or -inf (never)."""
    return type(value) in _PLAIN and -math.inf <= value < math.inf  # type: ignore[operator]


def _check_state(state: FleetScalerState) -> None:
    """Check every field of ``state`` (:class:`FleetScalerState`, Raises), naming the first bad one.

    Raises:
        InputError: ``fleet scaler: state.<field>: expected ..., got ...``.
    """
    for name in ("instances", "out_count", "in_count", "over_count"):
        check_number(getattr(state, name), "fleet scaler", f"state.{name}", integer=True, ge=0)
    if state.ema_rps is not None:
        check_number(state.ema_rps, "fleet scaler", "state.ema_rps", ge=0, unit="req/s")
    check_number(state.trend_rps_per_s, "fleet scaler", "state.trend_rps_per_s", unit="req/s per s")
    for name in ("last_sample_s", "outage_since_s"):
        if getattr(state, name) is not None:
            check_number(getattr(state, name), "fleet scaler", f"state.{name}", unit="s; or None")
    for name in ("last_change_s", "last_out_s"):
        if not (isinstance(getattr(state, name), numbers.Real) and getattr(state, name) == -math.inf):
            check_number(getattr(state, name), "fleet scaler", f"state.{name}", unit="s; or -inf: never")


@dataclass(frozen=True)
class FleetDecision:
    """One sample's verdict: ``instances`` before and after (equal when holding), and why."""

    t_s: float
    from_instances: int
    to_instances: int
    reason_kind: FleetReasonKind
    reason: str

    @property
    def changed(self) -> bool:
        return self.to_instances != self.from_instances


class FleetScaler:
    """Decides the serving instance count of a :class:`~flexpipe_dag.planner.fleet.FleetPlan` (module docstring)."""

    def __init__(self, plan: FleetPlan, config: FleetScalerConfig | None = None):
        if not plan.instances:
            raise InputError("fleet scaler", "plan", "the plan has no instances")
        if config is not None and not isinstance(config, FleetScalerConfig):
            raise InputError("fleet scaler", "config", f"got a {type(config).__name__}; expected a FleetScalerConfig")
        self.plan = plan
        self.config = config or FleetScalerConfig()
        self._cum = [0.0]
        for inst in plan.instances:
            self._cum.append(self._cum[-1] + inst.rps_max)

    def capacity_rps(self, instances: int) -> float:
        """Summed envelope of the first ``instances`` instances, req/s."""
        return self._cum[max(0, min(instances, len(self.plan.instances)))]

    def initial_state(self, rps: float) -> FleetScalerState:
        """The state for a fleet started for ``rps`` req/s (the fewest instances holding it with headroom).

        Raises:
            InputError: ``rps`` negative or not finite.
        """
        check_number(rps, "fleet scaler", "rps", ge=0, unit="req/s")
        return FleetScalerState(instances=max(1, self.plan.instances_for(rps, self.config.headroom_fraction)))

    def _holds_for_s(self, t_s: float, rps: float, capacity: float, forecast: ForecastFn | None) -> float:
        """How long the forecast says ``capacity`` x (1 - headroom) holds, seconds (one dwell without a forecast,
        or when it fails on the way: :func:`~flexpipe_dag.control.controller.read_forecast`)."""
        c = self.config
        if forecast is None or c.forecast_horizon_s <= 0:
            return c.dwell_s
        limit = capacity * (1.0 - c.headroom_fraction)
        horizon = 0.0
        while horizon < c.forecast_horizon_s:
            nxt = min(c.forecast_horizon_s, horizon + c.sample_period_s)
            expected, error = read_forecast(forecast, t_s, rps, nxt)
            if error is not None:
                return c.dwell_s
            if expected is not None and expected > limit:
                return horizon
            horizon = nxt
        return horizon

    def _smooth(self, state: FleetScalerState, t_s: float, rps: float) -> tuple[float, float]:
        """Holt's linear smoothing of the rate (Holt 1957, repr. Int. J. Forecasting 20(1), 2004): level
        ``L = a x rps + (1 - a)(L' + T' dt)`` and trend ``T = b (L - L') / dt + (1 - b) T'``, with ``a`` =
        ``rps_ema_alpha``, ``b`` = ``trend_beta`` and ``dt`` the time since the last sample; ``b`` = 0 is the
        plain EMA. Returns ``(L, T)`` in req/s and req/s per second."""
        c = self.config
        if state.ema_rps is None:
            return rps, 0.0
        a, b = c.rps_ema_alpha, c.trend_beta
        if state.last_sample_s is None or t_s <= state.last_sample_s:
            dt = c.sample_period_s
        else:  # a reading much sooner than a period apart is no rate of change: 30 -> 31 req/s 1 ms later is not
            dt = max(t_s - state.last_sample_s, 0.5 * c.sample_period_s)  # +1,000 req/s per s (a scale-out to all)
        if b <= 0:
            return a * rps + (1 - a) * state.ema_rps, 0.0
        level = max(0.0, a * rps + (1 - a) * (state.ema_rps + state.trend_rps_per_s * dt))  # a rate is never < 0
        return level, b * (level - state.ema_rps) / dt + (1 - b) * state.trend_rps_per_s

    def decide(self, state: FleetScalerState, t_s: float, rps: float,
               forecast: ForecastFn | None = None, queued: float = 0.0) -> tuple[FleetScalerState, FleetDecision]:
        """One sample: observed request rate ``rps`` (req/s, >= 0) at ``t_s`` and ``queued`` requests waiting
        beyond what the instances serve in time; returns the next state and the decision.

        A queue adds ``queued / backlog_drain_s`` req/s to the load the instances must hold (so a
        backlog after a surge is drained in about ``backlog_drain_s``, not by the headroom alone).

        Raises:
            InputError: ``rps`` or ``queued`` negative, not finite or beyond
                :data:`~flexpipe_dag.control.config.MAX_FIGURE`; ``t_s`` not finite or before the last sample's.
        """
        check_number(rps, "fleet scaler", "rps", ge=0, le=MAX_FIGURE, unit="req/s")
        check_number(queued, "fleet scaler", "queued", ge=0, le=MAX_FIGURE, unit="requests")
        check_number(t_s, "fleet scaler", "t_s", unit="s")
        if state.last_sample_s is not None and t_s < state.last_sample_s:  # an outage / dwell of negative seconds
            raise InputError("fleet scaler", "t_s", f"got {t_s:g}, before the last sample's {state.last_sample_s:g} s; "
                                                    "expected samples in time order")
        if not 1 <= state.instances <= len(self.plan.instances):
            raise InputError("fleet scaler", "state.instances",
                             f"got {state.instances}; expected 1..{len(self.plan.instances)} (the plan's instances)")
        c = self.config
        ema, trend = self._smooth(state, t_s, rps)
        sizing = c.sizing_lead_s > 0  # else the forecast is read for the payback test only (its errors noted here)
        expected, forecast_error = read_forecast(forecast, t_s, ema, c.sizing_lead_s if sizing else c.forecast_horizon_s)
        fc = expected if sizing and expected is not None else ema
        forecast_note = f"; forecast ignored: {forecast_error}" if forecast_error else ""
        drain_rps = queued / c.backlog_drain_s
        lead_s = c.instance_warmup_s + c.sample_period_s  # until capacity ordered now serves, and the next look
        rise_rps = max(0.0, trend) * lead_s
        load = max(ema + rise_rps, fc) + drain_rps
        observed, rps = rps, rps + drain_rps
        n = state.instances
        cap = self.capacity_rps(n)
        n_out = self.plan.instances_for(load, c.headroom_fraction)
        if n_out > n and rps > ema:  # a scale-out is sized for the latest rate when it is above the smoothed one
            n_out = max(n_out, self.plan.instances_for(max(rps + rise_rps, load), c.headroom_fraction))
        n_in = max(1, self.plan.instances_for(load, c.scale_in_headroom_fraction))
        landing_headroom = (c.headroom_fraction + c.scale_in_headroom_fraction) / 2
        over_count = state.over_count + 1 if rps > cap else 0
        outage_since = None  # the traffic vanished (not a tide's fall) and has not come back yet, by either reading
        if min(observed, ema) < c.outage_fraction * cap and n > 1:
            outage_since = state.outage_since_s if state.outage_since_s is not None else t_s
        outage_hold = outage_since is not None and t_s - outage_since < c.outage_hold_s
        if over_count >= c.overload_samples:     # overloaded now: size for the raw rate, at once
            n_out = max(n_out, self.plan.instances_for(rps, c.headroom_fraction))
        out_count = state.out_count + 1 if n_out > n else 0
        in_count = state.in_count + 1 if n_in < n and not outage_hold else 0  # counted afresh after an outage
        st = replace(state, ema_rps=ema, trend_rps_per_s=trend, last_sample_s=t_s, out_count=out_count,
                     in_count=in_count, over_count=over_count, outage_since_s=outage_since)
        figures = (f"smoothed {ema:.1f} req/s"
                   + (f" rising {trend * 60:.1f} req/s per min (sized for {load - drain_rps:.1f} in {lead_s:.0f} s)"
                      if trend > 0 else "")
                   + (f", forecast {fc:.1f} req/s" if sizing else "")
                   + (f", {queued:.0f} queued (+{drain_rps:.1f} req/s to drain)" if queued > 0 else "")
                   + f", {n} instance(s) hold {cap:.1f} req/s{forecast_note}")

        def hold(kind: FleetReasonKind, why: str) -> tuple[FleetScalerState, FleetDecision]:
            return st, FleetDecision(t_s, n, n, kind, f"{why} ({figures})")

        if out_count >= c.scale_out_samples or (over_count >= c.overload_samples and n_out > n):
            if t_s - state.last_out_s < c.scale_out_dwell_s:
                return hold("dwell", f"scale-out to {n_out} waits: the last scale-out was "
                                     f"{t_s - state.last_out_s:.0f} s ago (< {c.scale_out_dwell_s:g} s)")
            new = replace(st, instances=n_out, out_count=0, in_count=0, over_count=0, last_change_s=t_s, last_out_s=t_s)
            why = (f"overloaded: {rps:.1f} req/s observed above the whole envelope for {over_count} sample(s)"
                   if over_count >= c.overload_samples else
                   f"load above {1 - c.headroom_fraction:.0%} of the envelope for {out_count} sample(s)")
            return new, FleetDecision(t_s, n, n_out, "scale_out",
                                      f"scale out {n} -> {n_out}: {why}; {n_out} hold {self.capacity_rps(n_out):.1f} "
                                      f"req/s ({figures})")
        if in_count >= c.hysteresis_samples:
            if t_s - state.last_change_s < c.dwell_s:
                return hold("dwell", f"scale-in to {n_in} waits: the last change was "
                                     f"{t_s - state.last_change_s:.0f} s ago (< {c.dwell_s:g} s)")
            n_in = max(1, self.plan.instances_for(load, landing_headroom))  # the band's middle: <= n_in < n
            kept = min(n - 1, self.plan.instances_for(cap * (1.0 - c.scale_in_max_fraction) * (1 - 1e-9), 0.0))
            step_note = (f" (at most {c.scale_in_max_fraction:.0%} of the envelope per scale-in: {n_in} would hold "
                         "it)" if kept > n_in else "")
            n_in = max(n_in, kept)  # always one instance back at least
            residence = self._holds_for_s(t_s, ema, self.capacity_rps(n_in), None if forecast_error else forecast)
            cost = c.scale_in_cost_s
            if residence <= cost:
                return hold("payback", f"scale-in to {n_in} declined: {n_in} instance(s) are expected to hold for "
                                       f"{residence:.0f} s, not more than the {cost:.0f} s of drain + warm-up it costs")
            new = replace(st, instances=n_in, out_count=0, in_count=0, last_change_s=t_s)
            return new, FleetDecision(t_s, n, n_in, "scale_in",
                                      f"scale in {n} -> {n_in}: fewer instances held the load with "
                                      f"{c.scale_in_headroom_fraction:.0%} headroom for {in_count} samples; {n_in} hold "
                                      f"it with {landing_headroom:.0%} and are expected to for {residence:.0f} s > "
                                      f"{cost:.0f} s of drain + warm-up{step_note} ({figures})")
        if outage_hold and outage_since is not None and n_in < n:
            return hold("outage", f"scale-in to {n_in} waits: the rate ({observed:.1f} req/s observed) is under "
                                  f"{c.outage_fraction:.0%} of the {n} instance(s)' envelope, an outage for "
                                  f"{t_s - outage_since:.0f} s; the traffic returns at its level, so they are held "
                                  f"for up to {c.outage_hold_s:g} s")
        counting = ""
        if out_count:
            counting = f": load above {1 - c.headroom_fraction:.0%} of the envelope, {out_count} of {c.scale_out_samples} samples"
        elif in_count:
            counting = f": {n_in} would hold it, {in_count} of {c.hysteresis_samples} samples"
        return hold("hold", f"hold {n} instance(s){counting}")
