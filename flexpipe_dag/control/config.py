"""Every figure the gear-shift controller uses, with the design's seed defaults.

Seed figures (``DESIGN.md``, "Seed figures the controller starts from"): sample every 2 s, EMA
alpha 0.3; imbalance when the busiest stage is > 0.9 utilised while the idlest is < 0.6; latency
over when P99 > 1.2 x target (shift toward the latency gear) and under when P99 < 0.7 x target
(back toward balanced / throughput); a condition must hold for 3 consecutive samples, the reverse
shift needs its own 3; 10 min minimum dwell after a shift; a shift must pay back
(estimated gain x expected residence > migration cost).

Beyond the seeds (each off by default): ``device_weight`` charges a gear for the devices it holds on
discretionary shifts (a fragmented fleet lends what the serving gear does not hold to offline work);
``forecast_horizon_s`` lets a load forecast (the tide's daily profile,
:mod:`flexpipe_dag.control.tide`) start a shift up before the rise; ``rps_ema_alpha`` smooths the
arrival rate apart from the rest; ``recent_peak_window_s`` keeps a shift down from landing in a gear
the last window's peak would overrun; ``reversal_window_s`` keeps two discretionary triggers from
ping-ponging between two gears.

"One step" of dwell escalation, precisely
-----------------------------------------
A trigger *fires* when its condition has held for the required number of consecutive smoothed
samples. If it fires inside the dwell, the shift is declined and the required count rises by
``dwell_escalation_samples`` (default 1) for **every** trigger, capped at
``hysteresis_max_samples``: 3 -> 4 -> 5 ... . One persistent condition raises it once (one
*episode*); the condition must clear (a sample where it does not hold) and come back to raise it
again, so a flapping load raises the bar and a sustained one does not. The raise decays one step per
``escalation_decay_s`` (default: one dwell, 600 s) without a further raise. After the dwell, the
next shift needs the raised count.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from flexpipe_dag.core.errors import shown
from flexpipe_dag.core.metrics import SAMPLE_PERIOD_S

Fraction = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Alpha = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
#: The forecast is a daily profile: looking further than a day ahead sees nothing new.
DAY_S = 86400.0
PositiveFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]

#: The smallest page and time budget of a sensor evaluation (``evaluation_page_samples``,
#: ``evaluation_budget_s``): below them a backlog can grow faster than evaluations read it.
MIN_PAGE_SAMPLES = 100
MIN_BUDGET_S = 0.1

#: Which P99 of :class:`~flexpipe_dag.core.metrics.MetricSample` the latency triggers watch.
LatencyMetric = Literal["ttft_p99_ms", "tpot_p99_ms", "e2e_p99_ms"]


#: Largest magnitude any control figure may take: every seed figure is within 0..1e4, and a dwell,
#: window or timeout of a billion seconds (31 years) is a typo, not a setting.
MAX_FIGURE = 1e9


class Figures(BaseModel):
    """Base of the control figure models: frozen, unknown keys refused, no booleans where numbers belong,
    and no number beyond :data:`MAX_FIGURE`.

    Numbers are strict, as a cluster profile's and a gear file's are: a string (``"0.5"``, a quoted YAML
    figure) is refused, not converted, and so is a float where a count belongs (``hysteresis_samples``
    3.0); an int is a float."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, value: object) -> object:
        if isinstance(value, bool):  # YAML's yes / on / true would otherwise read as 1
            raise ValueError(f"expected a number, got the boolean {value}")
        if isinstance(value, (int, float)) and abs(value) > MAX_FIGURE:
            raise ValueError(f"{shown(value, 40)} is beyond {MAX_FIGURE:g}; expected a figure of a sane size")
        return value


class ControllerConfig(Figures):
    """Configuration of :class:`flexpipe_dag.control.controller.Controller` (all seed figures).

    Units are in the field names: ``_s`` seconds, ``_ms`` milliseconds, ``_fraction`` 0..1,
    ``_samples`` a count of 2-s metric samples.

    Raises:
        pydantic.ValidationError: a figure out of range (e.g. ``ema_alpha`` not in (0, 1],
            ``latency_under_factor >= latency_over_factor``, ``imbalance_min_util >= imbalance_max_util``).
    """

    sample_period_s: PositiveFloat = SAMPLE_PERIOD_S
    ema_alpha: Alpha = 0.3
    rps_ema_alpha: Alpha | None = Field(
        None, validation_alias=AliasChoices("rps_ema_alpha", "qps_ema_alpha"),  # qps_ema_alpha: the old name
        description="EMA alpha of the arrival rate alone; None = ema_alpha. At ~1 req/s a 2-s sample holds "
                          "~2 arrivals, so alpha 0.3 (about 6 s of history) swings by tens of per cent with "
                          "Poisson noise and bursts; 0.1 (about 20 s) steadies envelope decisions at low rates")

    # triggers ------------------------------------------------------------------------------------
    imbalance_max_util: Fraction = 0.9
    imbalance_min_util: Fraction = 0.6
    latency_metric: LatencyMetric = "ttft_p99_ms"
    target_p99_ms: PositiveFloat | None = Field(
        None, description="service latency SLO; None = the SLO the serving gear's envelope was measured at "
                          "(envelope_basis: slo_ttft_ms for ttft_p99_ms, slo_tpot_ms for tpot_p99_ms), else the gear's "
                          "own target_p99_ms")
    latency_over_factor: PositiveFloat = 1.2
    latency_under_factor: PositiveFloat = 0.7
    envelope_margin_fraction: Fraction = Field(
        0.05, description="request rate must leave [rps_min x (1 - m), rps_max x (1 + m)] to count as outside the envelope")

    # hysteresis and dwell -----------------------------------------------------------------------
    hysteresis_samples: Annotated[int, Field(ge=1)] = 3
    hysteresis_max_samples: Annotated[int, Field(ge=1)] = 10
    dwell_s: NonNegFloat = 600.0
    overload_dwell_s: NonNegFloat | None = Field(
        None, description="the dwell a shift up waits out when the request rate itself is over the serving gear's "
                          "envelope (rps_above_envelope: only to a gear with more capacity), s; every other shift, a "
                          "forecast's included, waits dwell_s. Like the Kubernetes HPA, which scales up at once and "
                          "holds scale-down for a stabilisation window: a shift down the load proves wrong is undone "
                          "before the queue builds. None (the seeds) = dwell_s")
    dwell_escalation_samples: Annotated[int, Field(ge=0)] = 1
    escalation_decay_s: PositiveFloat = 600.0

    # payback ------------------------------------------------------------------------------------
    default_residence_s: PositiveFloat = Field(
        1800.0, description="expected residence in a gear before any residence has been observed")
    residence_ema_alpha: Alpha = 0.3
    default_migration_cost_s: NonNegFloat = Field(
        30.0, description="migration cost assumed when the caller passes no migration_cost_s function")
    min_gain_fraction: NonNegFloat = Field(
        0.02, description="a shift whose estimated goodput gain is below this is not worth proposing")
    headroom_weight: NonNegFloat = Field(
        0.1, description="value of one unit of spare capacity fraction relative to one unit of goodput "
                         "fraction; lets 'latency under' move to a roomier gear when goodput is equal")
    latency_weight: NonNegFloat = Field(
        0.1, description="value of one unit of latency slack fraction (1 - p99 / target) relative to goodput; "
                         "lets 'request rate below envelope' return to a faster gear when goodput is equal")
    envelope_fit_weight: NonNegFloat = Field(
        0.05, description="value of serving inside the planner's envelope for the smoothed request rate")
    device_weight: NonNegFloat = Field(
        0.0, description="cost of the devices a gear holds, per unit of device fraction "
                         "(n_new - n_old) / max(n_new, n_old), relative to goodput: a shift to a gear on more "
                         "devices must buy more service than the devices it takes from the fleet (offline work in "
                         "the troughs, other tenants), and one to fewer devices gains what it hands back; 0 "
                         "(the seeds) = devices are free; 0.2 keeps a cheap gear that holds the load")
    recent_peak_window_s: NonNegFloat = Field(
        0.0, description="a discretionary shift (imbalance, latency under target, request rate below the envelope) to a "
                          "gear with less capacity must go to one whose envelope holds the highest smoothed request rate "
                          "of this window: the shift cannot be undone inside the dwell, so a dip in the load must "
                          "not land the pipeline in a gear the next burst overruns; 0 (the seeds) = off; one dwell "
                          "(600 s) pairs with device_weight, which makes shifts down worth more")
    reversal_window_s: NonNegFloat = Field(
        0.0, description="a discretionary shift may not undo the previous discretionary shift (back to the gear it "
                         "left) within this long: two discretionary triggers that pull opposite ways (latency under "
                         "target toward a roomier gear, imbalance or low load back) do not ping-pong; shifts the "
                         "load forces are not held back; 0 (the seeds) = off")

    downshift_headroom_fraction: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] = Field(
        0.0, description="fewest devices once the load allows: with h > 0, trigger fewer_devices_hold fires when a "
                         "healthy gear on fewer devices than the serving one holds the smoothed request rate, the "
                         "recent peak (recent_peak_window_s) and the forecast with headroom h (all <= rps_max x "
                         "(1 - h)), and a discretionary shift down (rps_below_envelope, fewer_devices_hold) goes to "
                         "the gear on the fewest devices that does, not the nearest kind; 0 (the seeds) = off")

    upshift_headroom_fraction: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] = Field(
        0.0, description="leave a gear before its envelope's top: with u > 0, rps_above_envelope and "
                         "forecast_above_envelope fire when the request rate (or the forecast) exceeds rps_max x "
                         "(1 - u) instead of rps_max x (1 + envelope_margin_fraction), and the shift goes to a gear "
                         "that holds it below its own rps_max x (1 - u) when one does; an envelope is measured at the "
                         "SLO attainment bar (e.g. 95 %), so a gear run near its top misses more than a roomier one; "
                         "below downshift_headroom_fraction when both are set (the band between them keeps a load "
                         "from flapping); 0 (the seeds) = off")

    # load forecast ------------------------------------------------------------------------------
    forecast_horizon_s: Annotated[float, Field(ge=0.0, le=DAY_S, allow_inf_nan=False)] = Field(
        0.0, description="look-ahead of the load forecast, on the samples' clock: with a forecast passed to "
                           "decide(), forecast_above_envelope fires when the highest request rate expected within this "
                           "horizon leaves the serving gear's envelope (the shift starts before the rise, not "
                           "after it), and rps_below_envelope waits while the forecast is back inside it; at most a day "
                           "(the forecast is a daily profile); "
                           "0 (the seeds) = ignore forecasts; one dwell (600 s) starts the shift up about as early as a "
                           "dwell allows")

    # shift bookkeeping --------------------------------------------------------------------------
    shift_timeout_s: PositiveFloat = Field(
        300.0, description="a shift not seen in the samples after this long is taken as failed/rolled back")

    decline_repeat_s: NonNegFloat = Field(
        600.0, description="a declined decision alike the last one stored for the run (same trigger, reason kind, "
                           "from and to gear) is stored again only after this long on the samples' clock: a trigger "
                           "that keeps firing with nowhere to go leaves one row per this many seconds, not one per "
                           "sample; 0 = store every declined decision")

    # live pipeline and sensor evaluations --------------------------------------------------------
    sample_freshness_s: PositiveFloat = Field(
        120.0, description="no shift is taken on samples whose newest was written (wall clock) more than this long "
                           "ago, nor on a serving run whose last heartbeat is older: the pipeline they describe is "
                           "not live; the seed is four of the sensors' 30-s evaluation intervals")
    evaluation_page_samples: Annotated[int, Field(ge=MIN_PAGE_SAMPLES, le=1_000_000)] = Field(
        5000, description="metric samples one read of an evaluation takes (a page); a backlog is read page by page; "
                          f"at least {MIN_PAGE_SAMPLES}: an evaluation reads at least one page, and one of 100 2-s "
                          "samples (200 s of serving) outpaces the samples a pipeline writes between two 30-s "
                          "evaluations, so a backlog always shrinks")
    evaluation_budget_s: Annotated[float, Field(ge=MIN_BUDGET_S, allow_inf_nan=False)] = Field(
        2.0, description="an evaluation stops reading pages after this long and keeps its place in the cursor (the "
                         "next evaluation goes on): a sensor evaluation stays well inside hosted deployments' limits; "
                         "decisions wait until the backlog is read, so they are those of one pass over it; at least "
                         f"{MIN_BUDGET_S:g} s: a smaller budget reads one page per evaluation and a busy pipeline "
                         "keeps the decision waiting (held as backlog) for good")

    @model_validator(mode="before")
    @classmethod
    def _one_name_for_the_rate_alpha(cls, data: object) -> object:
        """``qps_ema_alpha`` (the name before ``rps``) reads too, but not beside ``rps_ema_alpha``."""
        if isinstance(data, dict) and "qps_ema_alpha" in data and "rps_ema_alpha" in data:
            raise ValueError("qps_ema_alpha (the old name) and rps_ema_alpha are both given; keep rps_ema_alpha")
        return data

    @model_validator(mode="after")
    def _check(self) -> ControllerConfig:
        if 0.0 < self.recent_peak_window_s < self.sample_period_s:
            raise ValueError(f"recent_peak_window_s: {self.recent_peak_window_s} must be 0 (off) or at least "
                             f"sample_period_s {self.sample_period_s}")
        if self.imbalance_min_util >= self.imbalance_max_util:
            raise ValueError(f"imbalance_min_util: {self.imbalance_min_util} must be below "
                             f"imbalance_max_util {self.imbalance_max_util}")
        if self.latency_under_factor >= self.latency_over_factor:
            raise ValueError(f"latency_under_factor: {self.latency_under_factor} must be below "
                             f"latency_over_factor {self.latency_over_factor}")
        if 0.0 < self.downshift_headroom_fraction <= self.upshift_headroom_fraction:
            raise ValueError(f"downshift_headroom_fraction: {self.downshift_headroom_fraction} must exceed "
                             f"upshift_headroom_fraction {self.upshift_headroom_fraction} (a gear entered with the "
                             f"headroom would be left at once)")
        if self.hysteresis_max_samples < self.hysteresis_samples:
            raise ValueError(f"hysteresis_max_samples: {self.hysteresis_max_samples} is below "
                             f"hysteresis_samples {self.hysteresis_samples}")
        return self
