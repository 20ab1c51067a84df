"""The gear-shift controller: metric samples in, a hold / shift decision with its reason out.

Pure and deterministic: :meth:`Controller.decide` takes the previous :class:`ControllerState`, the
new :class:`~flexpipe_dag.core.metrics.MetricSample` s (from the simulator or the live runtime, same
schema), the candidate gears and their health, and returns the next state and a
:class:`Decision`. Nothing is kept on the object, so a Dagster sensor can hold the state in its
cursor and a replay of the same inputs gives the same decisions.

Per sample (in ``t_s`` order; samples not newer than the state's last are skipped, so re-reading a
window is harmless):

1. If the serving gear changed (a shift took effect), record its residence, restart the per-gear
   averages (P99, stage utilisation) and every hysteresis counter: the reverse shift needs its own
   ``hysteresis_samples``.
2. Update the EMAs (alpha 0.3): ``ema = alpha x x + (1 - alpha) x ema``, first sample = its value.
3. Evaluate each trigger on the smoothed values; count consecutive samples it holds, reset on a
   sample where it does not.

   ==================== ==========================================================================
   trigger              condition (smoothed; T = latency target)
   ==================== ==========================================================================
   current_unhealthy    the serving gear carries a health tag (acts on 1 sample, ignores dwell and
                        payback: a failing gear must be left)
   rps_above_envelope   request rate > rps_max x (1 + envelope_margin_fraction), or > rps_max x (1 - u)
                        with ``upshift_headroom_fraction`` u > 0 (so is forecast_above_envelope's bar)
   forecast_above_      with a forecast: the highest request rate expected within ``forecast_horizon_s``
   envelope             > rps_max x (1 + margin) while request rate itself is not yet (shift before the rise)
   latency_over         P99 > latency_over_factor (1.2) x T
   imbalance            max stage utilisation > 0.9 while min < 0.6 (>= 2 stages)
   rps_below_envelope   request rate < rps_min x (1 - envelope_margin_fraction), and so is the forecast
   latency_under        P99 < latency_under_factor (0.7) x T
   fewer_devices_hold   with ``downshift_headroom_fraction`` h > 0: a healthy gear on fewer devices holds the
                        request rate, the recent peak and the forecast with headroom h (each <= its
                        rps_max x (1 - h))
   ==================== ==========================================================================

4. A trigger *fires* when its count reaches the required samples (3, raised by dwell escalation).
   Firing inside the dwell with a gear it would move to raises the requirement one step (see
   :mod:`flexpipe_dag.control.config`); ``fewer_devices_hold``, a standing preference rather than a
   sign of flapping, never does.

The forecast (``decide(..., forecast=f)``, ``f(t_s, rps, horizon_s) -> req/s``, e.g.
:func:`flexpipe_dag.control.tide.tide_forecast`) is the caller's: the controller asks it at every
sample for the highest load expected within ``forecast_horizon_s`` given the smoothed request rate. Without
one (or with ``forecast_horizon_s = 0``) the controller reacts to the load it sees only.

Then once per call, at ``now_s``: with a shift still pending, hold; otherwise take the
highest-priority firing trigger and rank the healthy candidate gears. A candidate's envelope must
hold the smoothed request rate (the forecast for ``forecast_above_envelope``) narrowed by
``envelope_margin_fraction`` (except for ``rps_above_envelope``, ``forecast_above_envelope`` and
``current_unhealthy``, which may move best-effort; the first two only to a gear with more capacity,
``rps_max``, than the serving one; ``latency_over`` on a backlogged gear,
whose P99 is its queue's, never to a gear with less capacity; with ``recent_peak_window_s``, a
discretionary trigger (imbalance, latency under, request rate below the envelope) never to a gear with less
capacity whose envelope does not hold the highest smoothed request rate of that window, nor, with a forecast,
the load it expects; with ``reversal_window_s``, a discretionary trigger never back to the gear the
previous discretionary shift left, inside that window): entering only well inside an envelope and
leaving only well outside it is what keeps a load near an edge from flapping. Candidates whose
calibrated P99 estimate meets the target come first, then the trigger's preferred kinds (like a
gearbox: the nearest gear in the trigger's direction), then net payback, which charges a gear for
the devices it holds (``device_weight``). The best one that passes
the payback test (:mod:`flexpipe_dag.control.payback`) is shifted to, unless inside the dwell.
Outside a failing gear, at most one shift happens per ``dwell_s``: with the seed 10 min, at most
6 per hour by construction. With ``overload_dwell_s`` set, a shift up that the load itself fires
(``rps_above_envelope``: the request rate over the serving gear's envelope) waits only that long
after the last shift, as Kubernetes' HPA scales up without the stabilisation window it keeps for
scaling down: a shift down the load proves wrong is undone before a queue builds, not after a dwell
of SLO misses. Every other shift, a forecast's included (a forecast is a guess; on openb day 3 one
moved to the 8-device gear hours early and missed more), still waits ``dwell_s`` after any shift.

Every decision, taken or declined, carries a one-sentence ``reason`` naming the trigger, the
smoothed figures against their thresholds, and the payback arithmetic or why the shift was
declined, and a ``reason_kind`` (:data:`~flexpipe_dag.control.state.ReasonKind`): ``dwell``,
``payback`` (the arithmetic, to three significant figures, with its sign taken from the test; a gain
under ``min_gain_fraction`` and a migration cost that was not estimated are said so),
``no_gear_holds`` (no healthy gear's envelope holds the load: the envelopes are listed, instead of a
best-effort move's payback alone) or ``no_candidate`` (gears hold the load but the trigger's rules
leave none). The latency target ``T`` is the SLO the user set, in the user's units: ``SLO TTFT 4000 ms``
(see :meth:`Controller.target_text`), not the P99 the planner measured at a gear's ``rps_max``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from flexpipe_dag.control.config import ControllerConfig
from flexpipe_dag.control.payback import (
    calibrated_p99_ms,
    capacity_rps,
    estimated_gain_fraction,
    figure,
    fits_envelope,
    payback_arithmetic,
    pays_back,
)
from flexpipe_dag.control.state import DISCRETIONARY_TRIGGERS, TRIGGER_PRIORITY, ControllerState, Decision
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.metrics import MetricSample

MigrationCostFn = Callable[[Gear, Gear], float]
#: ``(t_s, rps, horizon_s) -> req/s``: the highest load expected within ``horizon_s`` after ``t_s`` (the
#: samples' clock), given the smoothed load ``rps`` now.
ForecastFn = Callable[[float, float, float], float]

_KIND_RANK = {"latency": 0, "balanced": 1, "throughput": 2}
#: Which way along latency (0) -> balanced (1) -> throughput (2) each trigger moves; like a gearbox,
#: the nearest gear in that direction is preferred, then the same kind, then the other way.
_DIRECTION: dict[str, int] = {"rps_above_envelope": +1, "forecast_above_envelope": +1, "latency_under": +1,
                              "rps_below_envelope": -1, "fewer_devices_hold": -1, "imbalance": 0,
                              "current_unhealthy": 0}
#: Triggers that do not raise the dwell threshold: an unhealthy gear acts at once, and fewer_devices_hold is a
#: standing preference (hand devices back when the load allows), not a sign of flapping; raising the threshold
#: for it would delay the shifts the load forces.
_NO_ESCALATION = frozenset({"current_unhealthy", "fewer_devices_hold"})
#: Discretionary triggers that shift down: with ``downshift_headroom_fraction`` on, they prefer the fewest devices.
_DOWN_TRIGGERS = frozenset({"rps_below_envelope", "fewer_devices_hold"})
#: Triggers that may move to a gear whose envelope does not hold the load (when none does, the
#: roomiest helps most; an unhealthy gear must be left regardless). The others need a fitting gear.
_RISING = frozenset({"rps_above_envelope", "forecast_above_envelope"})
_BEST_EFFORT_TRIGGERS = frozenset({"rps_above_envelope", "forecast_above_envelope", "current_unhealthy"})
#: The SLO field of a gear's envelope basis for each latency metric, and how a reason names it.
_SLO_FIELDS = {"ttft_p99_ms": ("slo_ttft_ms", "TTFT"), "tpot_p99_ms": ("slo_tpot_ms", "TPOT")}
#: Gears a "no gear holds this load" reason lists by name; more are counted.
_LISTED_ENVELOPES = 6


@dataclass(frozen=True)
class _Candidate:
    gear: Gear
    fits: bool  # its envelope holds the smoothed request rate (with the entry margin)
    meets: bool  # its calibrated P99 estimate meets the latency target
    preference: int
    gain_fraction: float
    migration_cost_s: float
    residence_s: float
    cost_estimated: bool  # migration_cost_s came from the caller's cost function, not the config's default

    @property
    def net_s(self) -> float:
        return self.gain_fraction * self.residence_s - self.migration_cost_s


def _pipeline_key(gear: Gear) -> tuple[object, ...]:
    """What decides a gear's behaviour: stages (layers, devices), batching and KV pool."""
    return (tuple((st.layer_start, st.layer_end, tuple(st.device_ids)) for st in gear.stages),
            gear.micro_batch_size, gear.max_inflight_micro_batches, gear.kv_capacity_tokens)


def read_forecast(forecast: ForecastFn | None, t_s: float, rps: float,
                  horizon_s: float) -> tuple[float | None, str | None]:
    """Ask ``forecast`` for the highest req/s expected within ``horizon_s`` after ``t_s`` (smoothed rate ``rps``).

    Returns ``(value, None)``; ``(None, None)`` without a forecast (or a horizon of 0); ``(None, why)``
    when it raised or returned anything but a finite rate >= 0: a failing forecast is ignored for
    that sample, never the sample itself.
    """
    if forecast is None or horizon_s <= 0:
        return None, None
    try:
        raw = forecast(t_s, rps, horizon_s)
        value = float(raw)
    except Exception as exc:
        return None, f"the forecast raised {type(exc).__name__}: {exc} at t_s={t_s:g}"
    if not (math.isfinite(value) and value >= 0):
        return None, f"the forecast returned {raw!r} at t_s={t_s:g}; expected finite req/s >= 0"
    return value + 0.0, None  # -0.0 -> 0.0


def _ema(old: float | None, x: float, alpha: float) -> float:
    return x if old is None else alpha * x + (1.0 - alpha) * old


def _fmt_min(seconds: float) -> str:
    return f"{seconds / 60.0:.1f}"


class Controller:
    """Decides when and where to shift gears. Stateless: the state travels in and out of :meth:`decide`.

    Args:
        config: every figure (seed defaults in :class:`ControllerConfig`).
    """

    def __init__(self, config: ControllerConfig | None = None):
        self.config = config or ControllerConfig()

    @staticmethod
    def initial_state() -> ControllerState:
        """A fresh state: no samples seen, no shift yet."""
        return ControllerState()

    # ------------------------------------------------------------------------------------------
    def required_samples(self, state: ControllerState) -> int:
        """Consecutive samples a trigger needs now: base hysteresis + escalation, capped."""
        cfg = self.config
        return min(cfg.hysteresis_max_samples,
                   cfg.hysteresis_samples + state.escalation_steps * cfg.dwell_escalation_samples)

    def target_p99_ms(self, gear: Gear) -> float:
        """The latency target the triggers and the gain compare P99 with, ms (see :meth:`target_text`)."""
        return self._target(gear)[0]

    def target_text(self, gear: Gear) -> str:
        """The latency target as a reason quotes it: ``SLO TTFT 4000 ms``, ``target 1000 ms`` or ``gear target 1000 ms``.

        The target is, first, ``controller.target_p99_ms`` when set (``target``); else the SLO the
        gear's envelope was measured at (``Gear.envelope_basis``: ``slo_ttft_ms`` for ``ttft_p99_ms``,
        ``slo_tpot_ms`` for ``tpot_p99_ms``; the planning SLO the user set, e.g.
        ``FLEXPIPE_SLO_TTFT_MS``) (``SLO``); else the gear's own ``target_p99_ms`` (``gear target``:
        a gear planned without an SLO, or ``e2e_p99_ms``, which has none).
        """
        return self._target(gear)[1]

    def _target(self, gear: Gear) -> tuple[float, str]:
        cfg = self.config
        if cfg.target_p99_ms is not None:
            return cfg.target_p99_ms, f"target {cfg.target_p99_ms:.0f} ms"
        slo = _SLO_FIELDS.get(cfg.latency_metric)
        if slo is not None and gear.envelope_basis is not None:
            ms = float(getattr(gear.envelope_basis, slo[0]))
            return ms, f"SLO {slo[1]} {ms:.0f} ms"
        return gear.target_p99_ms, f"gear target {gear.target_p99_ms:.0f} ms"

    @staticmethod
    def backlogged(state: ControllerState) -> bool:
        """More requests wait for admission than run (smoothed, and at least one waits)."""
        q, r = state.ema_queue_length, state.ema_running
        return q is not None and q > max(1.0, r or 0.0)

    def dwell_for(self, trigger: str | None) -> float:
        """The dwell ``trigger`` waits out after the last shift, s: ``overload_dwell_s`` for
        ``rps_above_envelope`` (the load itself over the serving gear's envelope; it moves only to a gear
        with more capacity) when set, else ``dwell_s``."""
        cfg = self.config
        if trigger == "rps_above_envelope" and cfg.overload_dwell_s is not None:
            return cfg.overload_dwell_s
        return cfg.dwell_s

    def in_dwell(self, state: ControllerState, t_s: float, trigger: str | None = None) -> bool:
        """True while less than :meth:`dwell_for` ``trigger`` (``dwell_s`` for none) has passed since the last
        shift decision."""
        return state.last_shift_s is not None and t_s - state.last_shift_s < self.dwell_for(trigger)

    # ------------------------------------------------------------------------------------------
    def observe(self, state: ControllerState | None, samples: Iterable[MetricSample], gears: Sequence[Gear], *,
                unhealthy: set[str] | frozenset[str] = frozenset(),
                migration_cost_s: MigrationCostFn | None = None,
                forecast: ForecastFn | None = None,
                raised_by: str | None = None) -> tuple[ControllerState, str | None]:
        """Consume new samples without deciding: the first half of :meth:`decide` (same arguments).

        Feeding a backlog page by page through ``observe`` (each call given the previous state and
        ``raised_by``), then the last page through :meth:`decide` with them, gives exactly the state and
        decision of one :meth:`decide` over the whole backlog.

        Returns:
            ``(new_state, the trigger that last raised the dwell threshold, else raised_by)``.

        Raises:
            InputError: duplicate gear ids, or a sample names a gear not among ``gears``.
        """
        st = (state or ControllerState()).model_copy(deep=True)
        by_id = self._index(gears)
        unhealthy = frozenset(unhealthy)
        cost_fn = migration_cost_s  # None: the config's default_migration_cost_s, said "not estimated" in reasons
        for sample in sorted(samples, key=lambda s: s.t_s):
            if st.last_sample_t_s is not None and sample.t_s <= st.last_sample_t_s:
                continue
            if sample.gear_id not in by_id:
                raise InputError("metric samples", "gear_id",
                                 f"sample at t_s={sample.t_s} names gear {sample.gear_id!r}, which is not among "
                                 f"the gears passed ({', '.join(sorted(by_id))})")
            # several instances' merged sample: the load one of them carries, against the gear's envelope
            raised_by = self._observe(st, sample.per_instance(), by_id, unhealthy, cost_fn, forecast) or raised_by
        return st, raised_by

    def decide(self, state: ControllerState | None, samples: Iterable[MetricSample], gears: Sequence[Gear], *,
               unhealthy: set[str] | frozenset[str] = frozenset(),
               migration_cost_s: MigrationCostFn | None = None,
               now_s: float | None = None,
               forecast: ForecastFn | None = None,
               raised_by: str | None = None) -> tuple[ControllerState, Decision]:
        """Consume new samples and decide whether to shift.

        Args:
            state: the previous state (``None`` = fresh). Not modified; a new one is returned.
            samples: new metric samples, any order; those with ``t_s`` not after the state's last
                consumed sample are skipped.
            gears: candidate gears, including the one serving (ids unique).
            unhealthy: gear ids carrying a health tag; never chosen as a target.
            migration_cost_s: ``(from_gear, to_gear) -> seconds`` (e.g.
                :func:`flexpipe_dag.control.migration.migration_cost_fn`); None = the config's
                ``default_migration_cost_s`` for every shift.
            now_s: decision time on the samples' clock; None = the newest sample's ``t_s``.
            forecast: load forecast ``(t_s, rps, horizon_s) -> req/s`` (see :data:`ForecastFn`),
                asked at every sample with the smoothed request rate and ``forecast_horizon_s``; None = none.
            raised_by: what :meth:`observe` returned for earlier pages of the same backlog (None = none).

        Returns:
            ``(new_state, decision)``. On ``"shift"`` the caller runs the shift; the controller
            holds until samples show the target serving (or ``shift_timeout_s`` passes).

        Raises:
            InputError: duplicate gear ids, or a sample names a gear not among ``gears``. A
                forecast that raises or returns anything but a finite rate >= 0 does not stop the
                controller: it decides without the forecast and says so in the reason.
        """
        st, raised_by = self.observe(state, samples, gears, unhealthy=unhealthy, migration_cost_s=migration_cost_s,
                                     forecast=forecast, raised_by=raised_by)
        by_id = self._index(gears)
        unhealthy = frozenset(unhealthy)
        cost_fn = migration_cost_s  # None: the config's default_migration_cost_s, said "not estimated" in reasons
        now_s = float(now_s if now_s is not None else
                      (st.last_sample_t_s if st.last_sample_t_s is not None else 0.0))
        self._decay_escalation(st, now_s)
        decision = self._decide_now(st, now_s, by_id, unhealthy, cost_fn, raised_by)
        if st.forecast_error is not None:
            decision = decision.model_copy(update={"reason": f"{decision.reason} [forecast ignored: "
                                                             f"{st.forecast_error}]"})
        return st, decision

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _index(gears: Sequence[Gear]) -> dict[str, Gear]:
        by_id: dict[str, Gear] = {}
        for i, g in enumerate(gears):
            if g.gear_id in by_id:
                raise InputError("gears", f"[{i}].gear_id", f"duplicate gear id {g.gear_id!r}")
            by_id[g.gear_id] = g
        return by_id

    def _observe(self, st: ControllerState, s: MetricSample, by_id: dict[str, Gear],
                 unhealthy: frozenset[str], cost_fn: MigrationCostFn | None, forecast: ForecastFn | None) -> str | None:
        """Fold one sample into ``st`` (in place). Returns the trigger that raised the threshold, if one did."""
        cfg = self.config
        t_s = float(s.t_s)  # the state holds floats only, so its JSON form reads back identical
        if st.gear_id != s.gear_id:
            if st.gear_id is not None and st.gear_since_s is not None:
                st.residence_ema_s = _ema(st.residence_ema_s, t_s - st.gear_since_s, cfg.residence_ema_alpha)
            # the first gear seen was serving before we looked: its residence is unknown
            st.gear_since_s = t_s if st.gear_id is not None else None
            st.gear_id = s.gear_id
            st.ema_p99_ms, st.ema_stage_busy = None, []
            st.counts, st.escalated = {}, []
            st.pending_to_gear_id = st.pending_since_s = None
        st.samples_seen += 1
        st.last_sample_t_s = t_s
        a = cfg.ema_alpha
        st.ema_rps = _ema(st.ema_rps, s.rps, cfg.rps_ema_alpha if cfg.rps_ema_alpha is not None else a)
        st.forecast_rps = self._forecast(st, forecast, t_s, st.ema_rps)
        self._note_peak(st, t_s)
        st.ema_queue_length = _ema(st.ema_queue_length, float(s.queue_length), a)
        st.ema_running = _ema(st.ema_running, float(s.running), a)
        st.ema_completed_rps = _ema(st.ema_completed_rps, s.completed / cfg.sample_period_s, a)
        p99 = getattr(s, cfg.latency_metric)
        if p99 is not None:
            st.ema_p99_ms = _ema(st.ema_p99_ms, float(p99), a)
        busy = [float(x.busy_fraction) for x in sorted(s.stages, key=lambda x: x.stage_index)]
        if busy:
            if len(busy) != len(st.ema_stage_busy):
                st.ema_stage_busy = busy
            else:
                st.ema_stage_busy = [_ema(o, x, a) for o, x in zip(st.ema_stage_busy, busy)]

        gear = by_id[st.gear_id]
        active = self._active_triggers(st, gear, unhealthy, by_id)
        for name in TRIGGER_PRIORITY:
            st.counts[name] = st.counts.get(name, 0) + 1 if name in active else 0
        st.counts = {k: v for k, v in st.counts.items() if v > 0}
        st.escalated = [t for t in st.escalated if t in st.counts]

        # a trigger firing inside the dwell (that would have a gear to move to) raises the threshold
        self._decay_escalation(st, t_s)
        if st.pending_to_gear_id is not None or not self.in_dwell(st, t_s):
            return None
        need = self.required_samples(st)
        fresh = [t for t in TRIGGER_PRIORITY if t not in _NO_ESCALATION and st.counts.get(t, 0) >= need
                 and t not in st.escalated and self.in_dwell(st, t_s, t)
                 and self._rank_candidates(st, gear, t, by_id, unhealthy, cost_fn)]
        if not fresh:
            return None
        st.escalated = sorted(set(st.escalated) | set(fresh))
        if need >= cfg.hysteresis_max_samples or cfg.dwell_escalation_samples == 0:
            return None
        st.escalation_steps += 1
        st.last_escalation_s = t_s
        return fresh[0]

    def _note_peak(self, st: ControllerState, t_s: float) -> None:
        window_s = self.config.recent_peak_window_s
        if window_s <= 0 or st.ema_rps is None:
            st.rps_peaks = []
            return
        bucket_s = window_s / 10.0
        start = math.floor(t_s / bucket_s) * bucket_s
        if st.rps_peaks and st.rps_peaks[-1][0] == start:
            st.rps_peaks[-1] = (start, max(st.rps_peaks[-1][1], st.ema_rps))
        else:
            st.rps_peaks.append((start, st.ema_rps))
        st.rps_peaks = [p for p in st.rps_peaks if p[0] + bucket_s > t_s - window_s]

    def _reverses(self, st: ControllerState, current: Gear, candidate: Gear | None) -> bool:
        last = st.last_discretionary_shift
        window_s = self.config.reversal_window_s
        if last is None or candidate is None or window_s <= 0 or st.last_sample_t_s is None:
            return False
        from_id, to_id, t_s = last
        return to_id == current.gear_id and from_id == candidate.gear_id and st.last_sample_t_s - t_s < window_s

    def _nowhere_text(self, st: ControllerState, current: Gear, trigger: str, why: str,
                      unhealthy: frozenset[str], by_id: dict[str, Gear]) -> str:
        """Why a firing trigger has no gear to go to: the load to hold and the rules that excluded gears."""
        text = f"declined: {why}, but no healthy gear whose envelope holds rps {self._planning_rps(st, trigger):.3g}/s"
        if trigger in DISCRETIONARY_TRIGGERS:
            must_hold = max(self.recent_peak_rps(st) or 0.0, st.forecast_rps or 0.0)
            if must_hold > 0 and trigger != "latency_under":  # latency_under only moves to roomier gears
                text += f" and, for a smaller gear, the recent peak or forecast {must_hold:.3g}/s"
            last = st.last_discretionary_shift
            if (last is not None and last[1] == current.gear_id and self._reverses(st, current, by_id.get(last[0]))):
                text += (f" (back to {last[0]} would undo the shift at t={last[2]:.0f} s inside reversal_window_s "
                         f"{self.config.reversal_window_s:.0f} s)")
        return text + f" suits it ({len(unhealthy & set(by_id))} of {len(by_id)} gears unhealthy)"

    @staticmethod
    def recent_peak_rps(st: ControllerState) -> float | None:
        """Highest smoothed request rate over the recent-peak window (None before any sample or with the rule off)."""
        return max((q for _, q in st.rps_peaks), default=None)

    def _forecast(self, st: ControllerState, forecast: ForecastFn | None, t_s: float, rps: float) -> float | None:
        """The forecast's req/s for this sample; None without one, or when it fails (``st.forecast_error`` says why)."""
        value, st.forecast_error = read_forecast(forecast, t_s, rps, self.config.forecast_horizon_s)
        return value

    def _decay_escalation(self, st: ControllerState, t_s: float) -> None:
        if st.escalation_steps == 0 or st.last_escalation_s is None:
            return
        steps = int((t_s - st.last_escalation_s) // self.config.escalation_decay_s)
        if steps > 0:
            st.escalation_steps = max(0, st.escalation_steps - steps)
            st.last_escalation_s += steps * self.config.escalation_decay_s
            if st.escalation_steps == 0:
                st.last_escalation_s = None

    def leave_above_rps(self, gear: Gear) -> float:
        """The request rate above which the load (or its forecast) leaves ``gear``: ``rps_max x (1 + margin)``, or
        ``rps_max x (1 - upshift_headroom_fraction)`` when that figure is set, req/s."""
        u = self.config.upshift_headroom_fraction
        return gear.rps_max * (1.0 - u) if u > 0 else gear.rps_max * (1.0 + self.config.envelope_margin_fraction)

    def _top_text(self, gear: Gear) -> str:
        u = self.config.upshift_headroom_fraction
        return (f"{1.0 - u:.0%} of envelope max {gear.rps_max:.3g}" if u > 0 else f"envelope max {gear.rps_max:.3g}")

    def headroom_load_rps(self, st: ControllerState) -> float:
        """The load a gear on fewer devices must hold with ``downshift_headroom_fraction`` to take over: the
        highest of the smoothed request rate, the recent peak and the forecast, req/s."""
        return max(st.ema_rps or 0.0, self.recent_peak_rps(st) or 0.0, st.forecast_rps or 0.0)

    def _holds_with_headroom(self, st: ControllerState, gear: Gear) -> bool:
        h = self.config.downshift_headroom_fraction
        return h > 0 and st.ema_rps is not None and self.headroom_load_rps(st) <= gear.rps_max * (1.0 - h)

    def _active_triggers(self, st: ControllerState, gear: Gear, unhealthy: frozenset[str],
                         by_id: dict[str, Gear]) -> set[str]:
        cfg = self.config
        active: set[str] = set()
        if cfg.downshift_headroom_fraction > 0 and any(
                g.gear_id not in unhealthy and len(g.device_ids) < len(gear.device_ids)
                and g.num_layers == gear.num_layers and self._holds_with_headroom(st, g) for g in by_id.values()):
            active.add("fewer_devices_hold")
        if gear.gear_id in unhealthy:
            active.add("current_unhealthy")
        if st.ema_rps is not None:
            m = cfg.envelope_margin_fraction
            ahead = st.forecast_rps
            top = self.leave_above_rps(gear)
            if st.ema_rps > top:
                active.add("rps_above_envelope")
            elif ahead is not None and ahead > top:
                active.add("forecast_above_envelope")
            elif gear.rps_min > 0 and max(st.ema_rps, ahead or 0.0) < gear.rps_min * (1.0 - m):
                active.add("rps_below_envelope")
        if st.ema_p99_ms is not None:
            target = self.target_p99_ms(gear)
            if st.ema_p99_ms > cfg.latency_over_factor * target:
                active.add("latency_over")
            elif st.ema_p99_ms < cfg.latency_under_factor * target:
                active.add("latency_under")
        busy = st.ema_stage_busy
        if len(busy) >= 2 and max(busy) > cfg.imbalance_max_util and min(busy) < cfg.imbalance_min_util:
            active.add("imbalance")
        return active

    # ------------------------------------------------------------------------------------------
    def _allowed(self, trigger: str, current: Gear, candidate: Gear) -> int | None:
        """Preference rank of ``candidate`` for ``trigger`` (lower is better), None if not allowed.

        ``latency_over`` prefers the latency gear, then balanced, then throughput ("shift toward
        latency"). The others move one way along latency -> balanced -> throughput (``_DIRECTION``):
        nearest kind in that direction first, then the same kind, then the opposite way; imbalance
        and an unhealthy serving gear prefer the same kind, then the nearest. ``latency_under``
        only moves toward roomier kinds. Kinds off that axis (manual, uniform, ...) rank last.
        """
        new = _KIND_RANK.get(candidate.kind)
        if trigger == "latency_over":
            return new if new is not None else 99
        cur = _KIND_RANK.get(current.kind, 1)
        if new is None:
            return None if trigger == "latency_under" else 99
        step = new - cur
        direction = _DIRECTION[trigger]
        if trigger == "latency_under" and step <= 0:
            return None
        if direction == 0:
            return abs(step)
        if step * direction > 0:
            return abs(step)
        return 10 + abs(step)  # same kind (10) or the opposite way (11, 12)

    @staticmethod
    def _planning_rps(st: ControllerState, trigger: str) -> float:
        """The load a candidate must hold: the smoothed request rate, or the forecast for ``forecast_above_envelope``."""
        rps = st.ema_rps or 0.0
        if trigger == "forecast_above_envelope" and st.forecast_rps is not None:
            rps = max(rps, st.forecast_rps)  # choose (and value) the gear for the load that is coming
        return rps

    def _rank_candidates(self, st: ControllerState, current: Gear, trigger: str, by_id: dict[str, Gear],
                         unhealthy: frozenset[str], cost_fn: MigrationCostFn | None) -> list[_Candidate]:
        """Healthy gears the trigger may move to, best first.

        A candidate's envelope must hold the smoothed request rate (narrowed by the margin), except for the
        best-effort triggers; order: envelope fits, calibrated P99 estimate meets the target,
        the trigger's kind preference, net payback ``gain x residence - cost``, gear id.
        """
        cfg = self.config
        rps = self._planning_rps(st, trigger)
        target = self.target_p99_ms(current)
        residence_s = max(cfg.dwell_s, st.residence_ema_s if st.residence_ema_s is not None
                          else cfg.default_residence_s)
        backlogged = self.backlogged(st)
        must_hold = max(self.recent_peak_rps(st) or 0.0, st.forecast_rps or 0.0)
        out: list[_Candidate] = []
        for g in by_id.values():
            if (g.gear_id == current.gear_id or g.gear_id in unhealthy or g.num_layers != current.num_layers
                    or _pipeline_key(g) == _pipeline_key(current)):
                continue  # same pipeline under another name behaves the same: nothing to gain
            pref = self._allowed(trigger, current, g)
            if pref is None:
                continue
            if trigger == "fewer_devices_hold" and not (len(g.device_ids) < len(current.device_ids)
                                                       and self._holds_with_headroom(st, g)):
                continue  # this trigger exists only to hand devices back, with the headroom asked for
            if trigger in _DOWN_TRIGGERS and cfg.downshift_headroom_fraction > 0:
                # fewest devices first among the gears that hold the load with headroom, then the gearbox order
                pref = (len(g.device_ids) if self._holds_with_headroom(st, g) else 1000 + pref)
            fits = fits_envelope(g, rps, cfg.envelope_margin_fraction)
            if trigger in _RISING and rps > self.leave_above_rps(g):
                fits = False  # it would be left again at once: only a best effort
            if not fits and trigger not in _BEST_EFFORT_TRIGGERS:
                continue  # a gear outside its envelope would trigger the reverse shift: flapping
            if trigger in _RISING and not fits and capacity_rps(g) <= capacity_rps(current):
                continue  # load beyond this gear's envelope: a gear with no more capacity cannot help
            if trigger == "latency_over" and backlogged and capacity_rps(g) < capacity_rps(current):
                continue  # a backlog's latency is the queue's: less capacity would drain it slower
            if trigger in DISCRETIONARY_TRIGGERS and self._reverses(st, current, g):
                continue  # would undo the last discretionary shift: two soft triggers ping-ponging
            if (trigger in DISCRETIONARY_TRIGGERS and must_hold > 0 and capacity_rps(g) < capacity_rps(current)
                    and min(g.rps_max * (1.0 - cfg.envelope_margin_fraction), self.leave_above_rps(g)) < must_hold):
                continue  # a dip: the recent peak or the coming load would overrun it, and the dwell locks it in
            est = calibrated_p99_ms(g, current, None if backlogged else st.ema_p99_ms, cfg.latency_metric,
                                    within_target_ms=target if fits else None)
            meets = est is None or est <= target
            gain = estimated_gain_fraction(trigger, current, g, rps=rps, current_p99_ms=st.ema_p99_ms,
                                           target_p99_ms=target, config=cfg,
                                           current_max_stage_busy=max(st.ema_stage_busy, default=None),
                                           current_completed_rps=st.ema_completed_rps, backlogged=backlogged)
            cost = cfg.default_migration_cost_s if cost_fn is None else float(cost_fn(current, g))
            if not (cost >= 0 and math.isfinite(cost)):
                raise InputError("migration_cost_s", f"{current.gear_id}->{g.gear_id}",
                                 f"expected finite seconds >= 0, got {cost!r}")
            out.append(_Candidate(g, fits, meets, pref, gain, cost, residence_s, cost_fn is not None))
        out.sort(key=lambda c: (not c.fits, not c.meets, c.preference, -c.net_s, c.gear.gear_id))
        return out

    def _describe(self, st: ControllerState, gear: Gear) -> str:
        cfg = self.config
        parts = []
        if st.ema_rps is not None:
            hi = "inf" if math.isinf(gear.rps_max) else f"{gear.rps_max:.3g}"
            ahead = "" if st.forecast_rps is None else f" (forecast {st.forecast_rps:.3g}/s)"
            where = ("above" if st.ema_rps > gear.rps_max else "below" if st.ema_rps < gear.rps_min else "in")
            parts.append(f"rps {st.ema_rps:.3g}/s{ahead} {where} envelope [{gear.rps_min:.3g}, {hi}]")
        if st.ema_p99_ms is not None:
            parts.append(f"{cfg.latency_metric.removesuffix('_ms')} {st.ema_p99_ms:.0f} ms vs {self.target_text(gear)}")
        if len(st.ema_stage_busy) >= 2:
            parts.append(f"stage utilisation {min(st.ema_stage_busy):.2f}..{max(st.ema_stage_busy):.2f}")
        return "; ".join(parts) if parts else "no metrics yet"

    def _trigger_text(self, st: ControllerState, gear: Gear, trigger: str) -> str:
        cfg = self.config
        target = self.target_text(gear)
        metric = cfg.latency_metric.removesuffix("_ms")
        n = st.counts.get(trigger, 0)
        if trigger == "current_unhealthy":
            return f"gear {gear.gear_id} is marked unhealthy"
        if trigger == "rps_above_envelope":
            what = f"rps {st.ema_rps:.3g}/s above {self._top_text(gear)}"
        elif trigger == "forecast_above_envelope":
            what = (f"forecast rps {st.forecast_rps or 0.0:.3g}/s within {_fmt_min(cfg.forecast_horizon_s)} min "
                    f"above {self._top_text(gear)} (now {st.ema_rps:.3g}/s)")
        elif trigger == "rps_below_envelope":
            what = f"rps {st.ema_rps:.3g}/s below envelope min {gear.rps_min:.3g}"
        elif trigger == "latency_over":
            what = f"{metric} {st.ema_p99_ms:.0f} ms > {cfg.latency_over_factor:g} x {target}"
        elif trigger == "latency_under":
            what = f"{metric} {st.ema_p99_ms:.0f} ms < {cfg.latency_under_factor:g} x {target}"
        elif trigger == "fewer_devices_hold":
            what = (f"a gear on fewer than {len(gear.device_ids)} devices holds rps {st.ema_rps or 0.0:.3g}/s, its "
                    f"recent peak and forecast ({self.headroom_load_rps(st):.3g}/s) with "
                    f"{cfg.downshift_headroom_fraction:.0%} headroom")
        else:
            what = (f"stage utilisation max {max(st.ema_stage_busy):.2f} > {cfg.imbalance_max_util:g} "
                    f"while min {min(st.ema_stage_busy):.2f} < {cfg.imbalance_min_util:g}")
        return f"{trigger} ({what}, {n} samples)"

    def _decide_now(self, st: ControllerState, now_s: float, by_id: dict[str, Gear], unhealthy: frozenset[str],
                    cost_fn: MigrationCostFn | None, raised_by: str | None) -> Decision:
        cfg = self.config
        need = self.required_samples(st)
        base = dict(t_s=now_s, from_gear_id=st.gear_id, required_samples=need)
        if st.gear_id is None:
            return Decision(action="hold", reason="hold: no metric samples yet", reason_kind="no_samples", **base)
        gear = by_id[st.gear_id]

        if st.pending_to_gear_id is not None:
            waited = now_s - (st.pending_since_s if st.pending_since_s is not None else now_s)
            if waited < cfg.shift_timeout_s:
                return Decision(action="hold", to_gear_id=st.pending_to_gear_id,
                                reason=f"hold: shift {st.gear_id} -> {st.pending_to_gear_id} in progress "
                                       f"(requested {waited:.0f} s ago)", reason_kind="in_progress", **base)
            note = (f"shift to {st.pending_to_gear_id} not seen serving after {waited:.0f} s "
                    f"(failed or rolled back); ")
            st.pending_to_gear_id = st.pending_since_s = None
        else:
            note = ""

        firing = [t for t in TRIGGER_PRIORITY
                  if st.counts.get(t, 0) >= (1 if t == "current_unhealthy" else need)
                  or (t == raised_by and t in st.counts)]  # fired at the lower threshold, then raised it
        if not firing:
            counting = [t for t in TRIGGER_PRIORITY if st.counts.get(t, 0) > 0]
            if counting:
                t = counting[0]
                reason = (f"hold: {self._trigger_text(st, gear, t)} of {need} needed; "
                          + self._describe(st, gear))
                return Decision(action="hold", trigger=t, reason=note + reason, reason_kind="counting", **base)
            return Decision(action="hold", reason=note + f"hold: no trigger ({self._describe(st, gear)})",
                            reason_kind="no_trigger", **base)

        trigger = firing[0]
        why = self._trigger_text(st, gear, trigger)
        forced = trigger == "current_unhealthy"
        ranked = self._rank_candidates(st, gear, trigger, by_id, unhealthy, cost_fn)
        if not ranked:
            for t in firing[1:]:  # a lower-priority trigger may still have somewhere to go
                alt = self._rank_candidates(st, gear, t, by_id, unhealthy, cost_fn)
                if alt:
                    trigger, why, ranked = t, self._trigger_text(st, gear, t), alt
                    break
        nothing_holds = self._no_gear_holds_text(st, trigger, by_id, unhealthy)
        if not ranked:
            if nothing_holds is not None:
                return Decision(action="hold", trigger=trigger, declined=True, reason_kind="no_gear_holds",
                                reason=note + f"declined: {why}; {nothing_holds}", **base)
            return Decision(action="hold", trigger=trigger, declined=True, reason_kind="no_candidate",
                            reason=note + self._nowhere_text(st, gear, trigger, why, unhealthy, by_id), **base)

        if not forced and self.in_dwell(st, now_s, trigger):
            best = ranked[0]
            since = now_s - (st.last_shift_s or 0.0)
            raised = (f"threshold raised to {need} samples" if raised_by is not None
                      else f"threshold stays at {need} samples")
            return Decision(action="hold", to_gear_id=best.gear.gear_id, trigger=trigger, declined=True,
                            reason=note + f"declined: {why}; inside dwell ({_fmt_min(since)} of "
                                          f"{_fmt_min(self.dwell_for(trigger))} min), {raised}",
                            estimated_gain_fraction=best.gain_fraction, migration_cost_s=best.migration_cost_s,
                            expected_residence_s=best.residence_s, reason_kind="dwell", **base)

        chosen = None
        for c in ranked:
            if forced or (c.gain_fraction >= cfg.min_gain_fraction
                          and pays_back(c.gain_fraction, c.residence_s, c.migration_cost_s)):
                chosen = c
                break
        if chosen is None:
            best = ranked[0]
            others = (f"; none of the {len(ranked) - 1} other candidate(s) pays back either" if len(ranked) > 1 else "")
            if nothing_holds is not None:  # best effort only: no candidate fits (those that fit rank first)
                text, kind = (f"{nothing_holds}; the best effort, {best.gear.gear_id}, does not pay back: "
                              f"{self._payback_text(best)}{others}"), "no_gear_holds"
            else:
                text, kind = (f"shift to {best.gear.gear_id} does not pay back: {self._payback_text(best)}{others}",
                              "payback")
            return Decision(action="hold", to_gear_id=best.gear.gear_id, trigger=trigger, declined=True,
                            reason=note + f"declined: {why}; {text}", reason_kind=kind,
                            estimated_gain_fraction=best.gain_fraction, migration_cost_s=best.migration_cost_s,
                            expected_residence_s=best.residence_s, **base)

        payback = "forced: serving gear is unhealthy" if forced else self._payback_text(chosen)
        if not chosen.fits and nothing_holds is not None:
            payback += f" (best effort: no gear holds rps {figure(self._planning_rps(st, trigger))}/s)"
        reason = (f"shift {gear.gear_id} ({gear.kind}) -> {chosen.gear.gear_id} ({chosen.gear.kind}): {why}; "
                  f"{payback}")
        st.last_shift_s = now_s
        if trigger in DISCRETIONARY_TRIGGERS:
            st.last_discretionary_shift = (gear.gear_id, chosen.gear.gear_id, now_s)
        st.pending_to_gear_id, st.pending_since_s = chosen.gear.gear_id, now_s
        st.counts, st.escalated = {}, []
        st.shifts += 1
        return Decision(action="shift", to_gear_id=chosen.gear.gear_id, trigger=trigger, reason=note + reason,
                        estimated_gain_fraction=chosen.gain_fraction, migration_cost_s=chosen.migration_cost_s,
                        expected_residence_s=chosen.residence_s, reason_kind="shift", **base)

    def _payback_text(self, c: _Candidate) -> str:
        """The payback arithmetic of candidate ``c``, and the minimum gain when ``c`` falls short of it."""
        text = payback_arithmetic(c.gain_fraction, c.residence_s, c.migration_cost_s, cost_estimated=c.cost_estimated)
        if c.gain_fraction < self.config.min_gain_fraction:
            joint = "but" if pays_back(c.gain_fraction, c.residence_s, c.migration_cost_s) else "and"
            text += f", {joint} the gain is below min_gain_fraction {self.config.min_gain_fraction:g}"
        return text

    def _no_gear_holds_text(self, st: ControllerState, trigger: str, by_id: dict[str, Gear],
                            unhealthy: frozenset[str]) -> str | None:
        """``no gear holds this load: ...`` when no healthy gear's envelope (the serving one's included), narrowed by
        the margin, holds the load the trigger plans for; None when one does."""
        m = self.config.envelope_margin_fraction
        rps = self._planning_rps(st, trigger)
        healthy = sorted((g for g in by_id.values() if g.gear_id not in unhealthy),
                         key=lambda g: (g.rps_max, g.gear_id))
        if any(fits_envelope(g, rps, m) for g in healthy):
            return None
        load = f"{'forecast ' if trigger == 'forecast_above_envelope' else ''}rps {figure(rps)}/s"
        listed = ", ".join(f"{g.gear_id} [{figure(g.rps_min)}, {figure(g.rps_max)}]"
                           for g in healthy[-_LISTED_ENVELOPES:])
        more = f" and {len(healthy) - _LISTED_ENVELOPES} smaller" if len(healthy) > _LISTED_ENVELOPES else ""
        envelopes = f" ({listed}{more})" if healthy else ""
        return (f"no gear holds this load: {load} is outside every healthy gear's envelope{envelopes} narrowed by "
                f"the {m * 100:g} % margin ({len(unhealthy & set(by_id))} of {len(by_id)} gears unhealthy)")
