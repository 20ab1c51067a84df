"""Offline admission in the troughs of the online tide (pure; the ``tide_sensor`` and the serve loop call it).

Forecast: seasonal-naive over the tide history. The daily profile ``p(tau)`` (mean rate per window
of the day over the history's whole days, :meth:`Tide.daily_profile`) is scaled to the live level by
the ratio of the observed smoothed online request rate to the profile at the current time of day, then read
ahead over the horizon::

    forecast(t) = max_{tau in [t, t + horizon]} p(tau) * (ema_rps / p(t))

Decision, against the serving gear's capacity ``C`` (its ``rps_max``), with hysteresis:

* admit queued offline work when ``max(ema_rps, forecast) < admit_below_fraction * C``;
* pause running offline work when ``ema_rps > pause_above_fraction * C`` (> the admit fraction),
  or the forecast says the rise arrives within the horizon (``forecast > pause_above_fraction * C``);
* otherwise keep the current state.

A change (admit or pause) takes effect only after it has been the decision for
``hysteresis_samples`` consecutive evaluations (:class:`TideGate`), so noise around a threshold does
not flap offline work on and off. Online always has priority: paused offline work resumes only
through a later admission.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from flexpipe_dag.control.config import Figures
from flexpipe_dag.core.errors import shown
from flexpipe_dag.workload.tide import Tide


class TideConfig(Figures):
    """Thresholds of offline admission (fractions of the serving gear's ``rps_max``)."""

    admit_below_fraction: float = Field(0.5, gt=0, le=1, allow_inf_nan=False)
    pause_above_fraction: float = Field(0.75, gt=0, le=1, allow_inf_nan=False)
    horizon_s: float = Field(1800.0, ge=0, le=86400.0, allow_inf_nan=False,
                             description="look-ahead of the forecast, tide seconds (at most a day: the forecast is a "
                                         "daily profile)")
    ema_alpha: float = Field(0.3, gt=0, le=1, allow_inf_nan=False)
    hysteresis_samples: int = Field(3, ge=1, description="consecutive evaluations an admit / pause must hold")
    time_compression: float = Field(1.0, gt=0, le=86400.0, allow_inf_nan=False,
                                    description="tide seconds per wall second (demos compress the day; at most a day "
                                                "per second)")
    history_file: str = Field("", description="the online tide history the forecasts read: a CSV of "
                                             "window_start_s,total_rate_req_per_s rows over whole days (UTC); empty "
                                             "= the bundled ServeGen 14-day tide")

    @field_validator("history_file")
    @classmethod
    def _history_exists(cls, value: str) -> str:
        """A history file is checked when the settings load, not when the first forecast reads it."""
        from flexpipe_dag.workload.bundled import BUNDLED_TRACES

        if value and value not in BUNDLED_TRACES and not Path(value).is_file():
            what = "not a regular file" if Path(value).exists() else "no such file"
            raise ValueError(f"{what}: {shown(value)}; expected a tide CSV (window_start_s,total_rate_req_per_s) "
                             f"or a bundled tide name ({', '.join(n for n, v in BUNDLED_TRACES.items() if v[1] == 'tide')})")
        return value

    @model_validator(mode="after")
    def _ordered(self) -> TideConfig:
        if self.pause_above_fraction <= self.admit_below_fraction:
            raise ValueError("pause_above_fraction must exceed admit_below_fraction (hysteresis)")
        return self


@dataclass(frozen=True)
class TideDecision:
    """``action`` for offline work now, with the figures behind it and a sentence for the operator."""

    action: Literal["admit", "pause", "keep"]
    ema_rps: float
    forecast_rps: float
    capacity_rps: float
    reason: str


def load_history(config: TideConfig) -> Tide:
    """The online tide history forecasts read: ``config.history_file``, else the bundled ServeGen tide.

    Raises:
        InputError: the file is missing or not a tide (file and field named).
    """
    from flexpipe_dag.workload.bundled import load_tide_trace

    return load_tide_trace(config.history_file or "servegen-tide")


class TideForecaster:
    """Seasonal-naive forecast of online load from a tide history (see module docstring)."""

    def __init__(self, tide: Tide):
        self.tide = tide
        self.profile = tide.daily_profile()
        self.window_s = tide.window_s

    def profile_at(self, tide_time_s: float) -> float:
        """Mean historical rate at this time of day (tide seconds since midnight of any day)."""
        k = int((tide_time_s % 86400) // self.window_s) % len(self.profile)
        return float(self.profile[k])

    def forecast_rps(self, tide_time_s: float, rps_now: float, horizon_s: float) -> float:
        """Highest online request rate expected within ``horizon_s`` tide seconds, scaled to the live level."""
        base = self.profile_at(tide_time_s)
        if base <= 0:
            return rps_now
        horizon_s = min(horizon_s, 86400.0)  # a daily profile repeats: a longer look-ahead sees nothing new
        steps = np.arange(tide_time_s, tide_time_s + horizon_s + self.window_s, self.window_s)
        peak = max(self.profile_at(t) for t in steps)
        return rps_now * peak / base


def tide_forecast(forecaster: TideForecaster, tide_time_of: Callable[[float], float],
                  time_compression: float = 1.0) -> Callable[[float, float, float], float]:
    """The gear-shift controller's load forecast, from a tide history.

    Args:
        forecaster: seasonal-naive forecaster over the tide history.
        tide_time_of: maps a time on the metric samples' clock (s) to tide time (s since a tide
            midnight, any day).
        time_compression: tide seconds per second of the samples' clock (a compressed replay or
            demo plays a day faster).

    Returns:
        ``forecast(t_s, rps, horizon_s) -> req/s``: the highest load expected within ``horizon_s``
        (samples' clock) after ``t_s``, scaled to the smoothed load ``rps`` (see
        :meth:`TideForecaster.forecast_rps`); what :meth:`Controller.decide
        <flexpipe_dag.control.controller.Controller.decide>` takes as ``forecast``.
    """
    def forecast(t_s: float, rps: float, horizon_s: float) -> float:
        return forecaster.forecast_rps(tide_time_of(t_s), rps, horizon_s * time_compression)

    return forecast


def ema(previous: float | None, value: float, alpha: float) -> float:
    """Exponential moving average step: ``alpha * value + (1 - alpha) * previous``."""
    return value if previous is None or math.isnan(previous) else alpha * value + (1 - alpha) * previous


def decide_offline(forecaster: TideForecaster, config: TideConfig, *, tide_time_s: float, ema_rps: float,
                   capacity_rps: float, offline_running: bool) -> TideDecision:
    """Admit, pause or keep offline work (see module docstring for the rule)."""
    forecast = forecaster.forecast_rps(tide_time_s, ema_rps, config.horizon_s)
    return offline_decision(config, ema_rps=ema_rps, forecast_rps=forecast, capacity_rps=capacity_rps,
                            offline_running=offline_running)


def offline_decision(config: TideConfig, *, ema_rps: float, forecast_rps: float, capacity_rps: float,
                     offline_running: bool) -> TideDecision:
    """The rule of :func:`decide_offline` on a forecast already read (req/s within ``config.horizon_s``): for a
    caller whose forecast is not a :class:`TideForecaster` (the mixed day's simulation reads the controller's)."""
    if not capacity_rps > 0 or math.isinf(capacity_rps):
        capacity_rps = float("inf")
    forecast = forecast_rps
    admit_at, pause_at = config.admit_below_fraction * capacity_rps, config.pause_above_fraction * capacity_rps
    figures = (f"online {ema_rps:.3g} req/s, forecast peak {forecast:.3g} req/s in the next "
               f"{config.horizon_s / 60:.0f} min, gear capacity {capacity_rps:.3g} req/s")
    if offline_running and (ema_rps > pause_at or forecast > pause_at):
        return TideDecision("pause", ema_rps, forecast, capacity_rps,
                            f"pause offline: {figures} (pause above {config.pause_above_fraction:.0%})")
    if not offline_running and max(ema_rps, forecast) < admit_at:
        return TideDecision("admit", ema_rps, forecast, capacity_rps,
                            f"admit offline: trough, {figures} (admit below {config.admit_below_fraction:.0%})")
    state = "running" if offline_running else "waiting"
    return TideDecision("keep", ema_rps, forecast, capacity_rps, f"keep offline {state}: {figures}")


class TideGate(BaseModel):
    """Hysteresis on offline admission: state kept between evaluations (JSON-serialisable for a sensor cursor).

    ``running`` is whether offline work is admitted; ``pending`` / ``count`` the change being
    confirmed and for how many consecutive evaluations it has been the decision.
    """

    model_config = ConfigDict(extra="forbid")
    running: bool = False
    pending: Literal["admit", "pause"] | None = None
    count: Annotated[StrictInt, Field(ge=0)] = 0

    def step(self, decision: TideDecision, required: int) -> tuple[TideGate, TideDecision | None]:
        """Feed one decision; returns the new gate and the decision to act on now (None = no change yet)."""
        if decision.action == "keep" or (decision.action == "admit") == self.running:
            return TideGate(running=self.running), None
        count = self.count + 1 if self.pending == decision.action else 1
        if count >= required:
            return TideGate(running=decision.action == "admit"), decision
        return TideGate(running=self.running, pending=decision.action, count=count), None
