"""Offline work in the online gear's spare capacity: the serve loop's trough rule, in the simulator.

The live serve loop (:mod:`flexpipe_dag.serving.serve`) already fills troughs inside the serving
pipeline: every control step it smooths the online request rate, asks the tide rule
(:func:`~flexpipe_dag.control.tide.decide_offline`, with :class:`~flexpipe_dag.control.tide.TideGate`'s
hysteresis) whether to admit or pause offline work against the serving gear's ``rps_max``, and while
admitted keeps at most ``max_offline_inflight`` batch requests in the pipeline (offline priority:
online requests are admitted first, and the simulator, like vLLM's recompute preemption, evicts
offline sequences when an online one needs their KV blocks). :class:`OfflineShare` does the same at
every metric sample of a simulated replay (:func:`~flexpipe_dag.control.replay.run_dynamic`), taking
the jobs from the day's :class:`~flexpipe_dag.control.offline_fill.OfflineBacklog` and submitting
them to the running :class:`~flexpipe_dag.sim.Simulator`.

How much it admits, with ``T`` the serving gear's seats (``micro_batch_size x
max_inflight_micro_batches``), ``q`` the smoothed online rate and ``P = pause_above_fraction x rps_max``
(the load at which the gate pauses)::

    in flight <= floor(seats_fraction x T x max(0, 1 - q / P))   while admitted; nothing new while paused

so the budget is the gear's spare capacity below the pause level, shrinking to nothing as online load
approaches it (default ``seats_fraction`` 1/16). Besides:

* a latency guard adds nothing new while the online P99 TTFT or TPOT of the samples (smoothed) is
  above ``guard_fraction`` (half) of its SLO: a deep pipeline whose online TPOT is already near the
  SLO lends nothing;
* at most ``per_step`` (2) new jobs per control step, so long prompts are not prefilled in one burst
  next to online requests (the whole room at once cost online requests their TTFT on the lab fleet's
  day 0);
* a paused gate lets the requests in flight finish (the runtime does not abort them); the
  simulator's KV eviction preempts them first when online needs the room. What counts: prompt +
output tokens of jobs finished by the end of the day (``until_s``); jobs unfinished then go back to
the front of the backlog (:meth:`OfflineShare.settle`), so a job completes once or stays in the
backlog, as on the free devices.

Pure: the tide rule, the simulator's results; no Dagster or SQL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from flexpipe_dag.control.controller import ForecastFn
from flexpipe_dag.control.offline_fill import Completion, OfflineBacklog
from flexpipe_dag.control.tide import TideConfig, TideDecision, TideGate, ema, offline_decision
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.metrics import MetricSample
from flexpipe_dag.sim import Simulator
from flexpipe_dag.sim.results import SimResult
from flexpipe_dag.workload.context import fit_to_context, over_context
from flexpipe_dag.workload.request import Request

#: Share of the serving gear's seats offline work may hold at once while admitted, at no online load (the rest
#: stay free for online arrivals). Measured on the mixed day (bench/mixed_day.py) before the budget shrank with
#: load and the latency guard: online SLO attainment on the lab fleet's day 0 was 0.968 at 1/2 of the seats,
#: 0.992 at 1/4, 0.9987 at 1/8 (0.9988 without sharing); on openb's day 0 (the 12-device gear has 768 seats)
#: 932 online requests missed at 1/8; with the shrinking budget and the guard at half the SLO, 14 at 1/8 and 8
#: at 1/16 (5 without sharing).
DEFAULT_SEATS_FRACTION = 0.0625
#: Most offline jobs submitted per control step (a ramp, not a burst of prefills).
DEFAULT_PER_STEP = 2
#: Share of each SLO (TTFT, TPOT) the online P99 must stay below for offline work to be added.
DEFAULT_GUARD_FRACTION = 0.5


@dataclass
class ShareOutcome:
    """What offline work inside the online pipeline did over the day.

    Attributes:
        completions: jobs finished by ``until_s``, day clock, in time order.
        submitted: jobs handed to the pipeline (taken from the backlog).
        put_back: jobs unfinished at ``until_s``, returned to the backlog.
        preempted: KV preemptions of offline sequences (recomputed later; work lost).
        decisions: the gate's admit / pause changes, ``(t_s, action, reason)``.
    """

    completions: list[Completion] = field(default_factory=list)
    submitted: int = 0
    put_back: int = 0
    preempted: int = 0
    decisions: list[tuple[float, str, str]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Processed tokens (prompt + output) of the completed jobs."""
        return sum(c.tokens for c in self.completions)


class OfflineShare:
    """Feeds backlog jobs into a running simulation's spare capacity in troughs (module docstring).

    Args:
        backlog: the day's offline jobs (shared with the free devices' instances).
        tide: the admit / pause thresholds, smoothing and hysteresis (``horizon_s`` unused: see ``horizon_s``).
        horizon_s: the forecast's look-ahead, seconds of the samples' clock.
        until_s: the end of the day: nothing is submitted after it, and later completions do not count.
        max_context_tokens: the model's context; longer jobs are cut from the left, as the instances on
            free devices serve them.
        seats_fraction: share of the serving gear's seats offline may hold at no online load (0 < f <= 1).
        per_step: most jobs submitted per control step (>= 1).
        slo_ttft_ms / slo_tpot_ms: the online SLO the latency guard compares the samples' P99s with, ms
            (None: no guard on that metric).
        guard_fraction: share of each SLO the online P99 must stay below for new offline work (0 < g <= 1).

    Raises:
        InputError: ``seats_fraction`` or ``guard_fraction`` outside (0, 1], ``per_step`` < 1, ``horizon_s`` < 0
            or ``until_s`` <= 0.
    """

    def __init__(self, backlog: OfflineBacklog, tide: TideConfig, *, horizon_s: float, until_s: float,
                 max_context_tokens: int | None = None, seats_fraction: float = DEFAULT_SEATS_FRACTION,
                 per_step: int = DEFAULT_PER_STEP, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                 guard_fraction: float = DEFAULT_GUARD_FRACTION):
        for name, value, ok, want in (
                ("seats_fraction", seats_fraction, 0 < seats_fraction <= 1, "0 < fraction <= 1"),
                ("guard_fraction", guard_fraction, 0 < guard_fraction <= 1, "0 < fraction <= 1"),
                ("per_step", per_step, per_step >= 1, "jobs >= 1"),
                ("horizon_s", horizon_s, horizon_s >= 0 and math.isfinite(horizon_s), "finite seconds >= 0"),
                ("until_s", until_s, until_s > 0 and math.isfinite(until_s), "finite seconds > 0")):
            if not ok:
                raise InputError("offline share", name, f"got {value!r}; expected {want}")
        self.backlog, self.tide, self.horizon_s, self.until_s = backlog, tide, horizon_s, until_s
        self.max_context_tokens, self.seats_fraction, self.per_step = max_context_tokens, seats_fraction, per_step
        self.guards = {"ttft_p99_ms": slo_ttft_ms, "tpot_p99_ms": slo_tpot_ms}
        self.guard_fraction = guard_fraction
        self.gate = TideGate()
        self.ema_rps: float | None = None
        self.ema_p99_ms: dict[str, float] = {}
        self.outcome = ShareOutcome()
        self._jobs: dict[str, Request] = {}

    def limit(self, gear: Gear) -> int:
        """Offline requests the serving ``gear`` may hold at once while admitted, at the smoothed online load."""
        seats = self.seats_fraction * gear.micro_batch_size * gear.max_inflight_micro_batches
        pause_rps = self.tide.pause_above_fraction * gear.rps_max
        spare = 1.0 if not (math.isfinite(pause_rps) and pause_rps > 0) else max(0.0, 1.0 - (self.ema_rps or 0.0) / pause_rps)
        return int(seats * spare)

    def guarded(self) -> str | None:
        """Why the latency guard holds new offline work back now (None: it does not)."""
        for metric, slo in self.guards.items():
            p99 = self.ema_p99_ms.get(metric)
            if slo is not None and p99 is not None and p99 > self.guard_fraction * slo:
                return f"online {metric.removesuffix('_ms')} {p99:.0f} ms > {self.guard_fraction:g} x SLO {slo:.0f} ms"
        return None

    def step(self, sim: Simulator, sample: MetricSample, gear: Gear, forecast: ForecastFn | None) -> TideDecision:
        """One control step at ``sample`` (the newest): smooth the load, run the gate, top up the pipeline."""
        self.ema_rps = ema(self.ema_rps, sample.rps, self.tide.ema_alpha)
        for metric in self.guards:
            value = getattr(sample, metric)
            if value is not None:
                self.ema_p99_ms[metric] = ema(self.ema_p99_ms.get(metric), float(value), self.tide.ema_alpha)
        ahead = self.ema_rps
        if forecast is not None and self.horizon_s > 0:
            value = float(forecast(sample.t_s, self.ema_rps, self.horizon_s))
            ahead = value if math.isfinite(value) and value >= 0 else self.ema_rps
        decision = offline_decision(self.tide, ema_rps=self.ema_rps, forecast_rps=ahead, capacity_rps=gear.rps_max,
                                    offline_running=self.gate.running)
        self.gate, acted = self.gate.step(decision, self.tide.hysteresis_samples)
        if acted is not None:
            self.outcome.decisions.append((sample.t_s, acted.action, acted.reason))
        if self.gate.running and sim.now_s < self.until_s and self.guarded() is None:
            room = min(self.limit(gear) - sim.offline_open, self.per_step)
            if room > 0:
                jobs = [self._fit(r) for r in self.backlog.take(room)]
                self._jobs.update((r.request_id, r) for r in jobs)
                self.outcome.submitted += len(jobs)
                sim.submit(jobs)
        return decision

    def _fit(self, job: Request) -> Request:
        """The job as served: its prompt cut from the left to the model's context (as the free devices' instances)."""
        limit = self.max_context_tokens
        if limit is None or not over_context(job.input_tokens, job.output_tokens, limit):
            return job
        inp, out = fit_to_context(job.input_tokens, job.output_tokens, limit)
        return Request(job.request_id, job.arrival_s, inp, out, job.klass, job.priority)

    def settle(self, result: SimResult) -> ShareOutcome:
        """Count the jobs finished by ``until_s`` and put the others back at the front of the backlog."""
        df = result.requests
        mine = df[df["request_id"].isin(list(self._jobs))]
        finish = mine["finish_s"].to_numpy(dtype=float)
        done = ~np.isnan(finish) & (finish <= self.until_s) & ~mine["rejected"].to_numpy(dtype=bool)
        out = self.outcome
        ids = mine["request_id"].tolist()
        tokens = (mine["input_tokens"] + mine["output_tokens"]).to_numpy()
        out_tokens = mine["output_tokens"].to_numpy()
        out.completions = sorted((Completion(float(finish[i]), ids[i], int(tokens[i]), int(out_tokens[i]), True)
                                  for i in range(len(ids)) if done[i]), key=lambda c: c.t_s)
        out.preempted = int(mine["preemptions"].sum())
        unfinished = [self._jobs[ids[i]] for i in range(len(ids)) if not done[i]]
        self.backlog.put_back(unfinished)
        out.put_back = len(unfinished)
        return out
