"""Closed-loop calibration: observed stage steps -> per-device efficiency factors -> re-scored gears.

Pure Python / numpy (no torch, Dagster or SQL imports). Entry points::

    cal = calibrate(spec, cluster, observations, dtype="fp32")        # fit (calibrate.py, fit.py)
    cm = cal.cost_model(spec, cluster)                                  # CostModel(device_overrides=...)
    result = rescore_gears(spec, cluster, cal, gears, margin=0.1)       # what moved; re-plan? (rescore.py)
    png = plot_predicted_vs_measured(before_cm, cm, observations)       # asset metadata (plots.py)

Modules: :mod:`observation` (the observed-step record, measured stage / link summaries), :mod:`work`
(an observed step's operator work), :mod:`fit` (robust Bayesian time-scale fit), :mod:`links`
(link latency / bandwidth), :mod:`calibrate`, :mod:`rescore`, :mod:`report` (fidelity report),
:mod:`plots`.
"""

from flexpipe_dag.calibration.calibrate import Calibration, DeviceCalibration, calibrate, predicted_step_ms
from flexpipe_dag.calibration.fit import FitSettings, TimeScaleFit, fit_time_scales
from flexpipe_dag.calibration.observation import StageObservation, link_summaries, stage_time_summaries
from flexpipe_dag.calibration.rescore import RescoreResult, rescore_gears

__all__ = [
    "Calibration", "DeviceCalibration", "FitSettings", "RescoreResult", "StageObservation", "TimeScaleFit",
    "calibrate", "fit_time_scales", "link_summaries", "predicted_step_ms", "rescore_gears", "stage_time_summaries",
]
