"""Calibration of the cost model, in one room.

* Reference fit (:mod:`reference`): the cost model's default per-class efficiency factors, fitted
  once to public A100 operator timings (vidur) and shipped as ``data/profiling/a100_efficiency.yaml``.
* Closed loop: observed stage steps of real runs -> per-device efficiency factors -> re-scored gears.

Pure Python / numpy (no torch, Dagster or SQL imports). Entry points::

    cal = calibrate(spec, cluster, observations, dtype="fp32")        # fit (calibrate.py, fit.py)
    cm = cal.cost_model(spec, cluster)                                  # CostModel(device_overrides=...)
    result = rescore_gears(spec, cluster, cal, gears, margin=0.1)       # what moved; re-plan? (rescore.py)
    png = plot_predicted_vs_measured(before_cm, cm, observations)       # asset metadata (plots.py)

Modules: :mod:`observation` (the observed-step record, measured stage / link summaries), :mod:`work`
(an observed step's operator work), :mod:`fit` (robust Bayesian time-scale fit), :mod:`links`
(link latency / bandwidth), :mod:`calibrate`, :mod:`rescore`, :mod:`report` (fidelity report),
:mod:`plots`, :mod:`reference`. The Dagster ``calibration`` asset (``assets/calibration.py``) and
``flexpipe calibrate`` (``cli/calibrate.py``) are wiring over these; the store keeps observations and
calibration versions (``sql/observations.py``); the runtime records the observations
(``runtime/observations.py``).
"""

from flexpipe_dag.calibration.calibrate import Calibration, DeviceCalibration, calibrate, predicted_step_ms
from flexpipe_dag.calibration.fit import FitSettings, TimeScaleFit, fit_time_scales
from flexpipe_dag.calibration.observation import StageObservation, link_summaries, stage_time_summaries
from flexpipe_dag.calibration.rescore import RescoreResult, rescore_gears

__all__ = [
    "Calibration", "DeviceCalibration", "FitSettings", "RescoreResult", "StageObservation", "TimeScaleFit",
    "calibrate", "fit_time_scales", "link_summaries", "predicted_step_ms", "rescore_gears", "stage_time_summaries",
]
