"""Robust Bayesian fit of a device's roofline time scales from observed step times (numpy only).

Model. For step ``i`` the cost model's unit terms (:func:`~flexpipe_dag.calibration.work.roofline_terms`,
ms, per operator class ``j``) are scaled by three per-device *time scales* ``k = (k_c, k_m, k_o)``
(1 = the profile is right; 2 = that term takes twice as long as profiled)::

    t_i(k) = sum_j  to_ij k_o + max( tc_ij k_c,  tm_ij k_m )

Fit (maximum a posteriori in log space, ``theta = log k``): log-normal prior
``theta ~ N(0, diag(prior_sd^2))`` (the profile, weighted by how much it is trusted), log-normal noise
on the measured times, Huber-weighted residuals ``r_i = log t_i(theta) - log y_i`` (Huber 1964,
``c = 1.345`` noise scales), solved by Levenberg-Marquardt-damped Gauss-Newton with the noise scale
re-estimated each round as 1.4826 x MAD of the residuals (a robust standard deviation). After
convergence, steps with ``|r| > reject_sigma`` noise scales are rejected as outliers and the fit
repeats on the rest. The posterior covariance is ``(J' W J / s^2 + diag(1 / prior_sd^2))^-1``.

A scale whose posterior standard deviation stays above ``identified_ratio`` x its prior's (the data
do not pin it, e.g. the compute scale from decode-only steps) is *not identified*: it is fixed at its
prior (1) and the others are refitted. A device with fewer than ``min_observations`` steps is not
fitted at all: it keeps its profiled values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from flexpipe_dag.calibration.work import predict_terms_ms

TERMS: tuple[str, ...] = ("compute", "memory", "overhead")
_HUGE_PRECISION = 1e12


@dataclass(frozen=True)
class FitSettings:
    """Knobs of :func:`fit_time_scales` (defaults in brackets).

    Attributes:
        prior_sd: prior standard deviation of ``log k`` per term ``(compute, memory, overhead)``:
            ``(0.5, 0.5, 3.0)`` - the probe measured peak FLOP/s and bandwidth on the device itself
            (trusted to a factor ~1.6), while the per-kernel overheads are GPU launch figures fitted on
            A100 (on a CPU worker or another GPU they may be off by an order of magnitude).
        min_observations: fewer steps on a device leave it unchanged [10].
        identified_ratio: posterior sd / prior sd above which a term is fixed at its prior [0.7].
        huber_c: Huber threshold in noise scales [1.345].
        reject_sigma: outlier threshold in noise scales [3.5].
        min_noise: floor of the noise scale in log space [0.02].
        max_iter: Gauss-Newton iterations per round [60].
    """

    prior_sd: tuple[float, float, float] = (0.5, 0.5, 3.0)
    min_observations: int = 10
    identified_ratio: float = 0.7
    huber_c: float = 1.345
    reject_sigma: float = 3.5
    min_noise: float = 0.02
    max_iter: int = 60

    def __post_init__(self) -> None:
        if len(self.prior_sd) != 3 or any(not (s > 0) for s in self.prior_sd):
            raise ValueError(f"prior_sd: expected three positive numbers, got {self.prior_sd}")
        if self.min_observations < 1:
            raise ValueError(f"min_observations: expected >= 1, got {self.min_observations}")


@dataclass(frozen=True)
class TimeScaleFit:
    """Result of :func:`fit_time_scales`.

    Attributes:
        scales: ``{term: k}`` time scale per term (1 = as profiled; > 1 slower than profiled).
        log_sd: posterior standard deviation of ``log k`` per term.
        identified: ``{term: bool}``; a term not identified stays at 1.
        confidence: ``{term: 1 - posterior sd / prior sd}`` in [0, 1] (0: the data taught nothing).
        num_observations / num_used / num_rejected: steps given, kept, rejected as outliers.
        noise_log_sd: robust spread of the residuals (log space) after the fit.
        fitted: False when there was too little evidence (then ``scales`` are all 1).
        median_ape_before / median_ape_after: median |pred - meas| / meas at k = 1 and at the fit.
    """

    scales: dict[str, float]
    log_sd: dict[str, float]
    identified: dict[str, bool]
    confidence: dict[str, float]
    num_observations: int
    num_used: int
    num_rejected: int
    noise_log_sd: float
    fitted: bool
    median_ape_before: float
    median_ape_after: float
    notes: list[str] = field(default_factory=list)


def _jacobian(theta: np.ndarray, tc: np.ndarray, tm: np.ndarray, to: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Predicted times ``(n,)`` and ``d log t / d theta`` ``(n, 3)``."""
    kc, km, ko = np.exp(theta)
    c, m, o = tc * kc, tm * km, to * ko
    compute_bound = c >= m
    pred = (o + np.where(compute_bound, c, m)).sum(axis=1)
    jac = np.stack([np.where(compute_bound, c, 0.0).sum(axis=1), np.where(compute_bound, 0.0, m).sum(axis=1),
                    o.sum(axis=1)], axis=1) / pred[:, None]
    return pred, jac


def _robust_scale(r: np.ndarray, floor: float) -> float:
    return max(floor, 1.4826 * float(np.median(np.abs(r - np.median(r))))) if len(r) else floor


def _huber_objective(theta: np.ndarray, tc: np.ndarray, tm: np.ndarray, to: np.ndarray, log_y: np.ndarray,
                     precision: np.ndarray, noise: float, c: float) -> float:
    pred, _ = _jacobian(theta, tc, tm, to)
    a = np.abs(np.log(pred) - log_y) / noise
    rho = np.where(a <= c, 0.5 * a**2, c * a - 0.5 * c**2)
    return float(rho.sum() + 0.5 * theta @ (precision * theta))


def _map_fit(tc: np.ndarray, tm: np.ndarray, to: np.ndarray, log_y: np.ndarray, precision: np.ndarray, s: FitSettings,
             theta0: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Huber-weighted MAP by damped Gauss-Newton from ``theta0``.

    Returns ``(theta, covariance, noise, score)``; ``score = n log(noise) + prior penalty`` (lower is
    better) compares optima reached from different starts.
    """
    theta = theta0.astype(float).copy()
    lam = 1e-3
    noise = _robust_scale(np.log(_jacobian(theta, tc, tm, to)[0]) - log_y, s.min_noise)
    for _ in range(s.max_iter):
        pred, jac = _jacobian(theta, tc, tm, to)
        r = np.log(pred) - log_y
        a = np.abs(r) / noise
        w = np.where(a <= s.huber_c, 1.0, s.huber_c / np.maximum(a, 1e-12))
        hess = (jac * w[:, None]).T @ jac / noise**2 + np.diag(precision)
        grad = (jac * (w * r)[:, None]).sum(axis=0) / noise**2 + precision * theta
        current = _huber_objective(theta, tc, tm, to, log_y, precision, noise, s.huber_c)
        while True:
            step = np.linalg.solve(hess + lam * np.diag(np.diag(hess) + 1e-12), -grad)
            trial = theta + step
            if _huber_objective(trial, tc, tm, to, log_y, precision, noise, s.huber_c) <= current or lam > 1e8:
                break
            lam *= 10
        lam = max(lam / 10, 1e-9)
        theta = trial
        new_noise = _robust_scale(np.log(_jacobian(theta, tc, tm, to)[0]) - log_y, s.min_noise)
        done = np.max(np.abs(step)) < 1e-7 and abs(new_noise - noise) < 1e-6 * noise
        noise = new_noise
        if done:
            break
    pred, jac = _jacobian(theta, tc, tm, to)
    a = np.abs(np.log(pred) - log_y) / noise
    w = np.where(a <= s.huber_c, 1.0, s.huber_c / np.maximum(a, 1e-12))
    hess = (jac * w[:, None]).T @ jac / noise**2 + np.diag(precision)
    # starts are compared on the Gaussian profile likelihood with the robust noise scale (n log s) plus
    # the prior: the Huber loss itself shrinks as the scale grows, so it cannot compare optima
    free = precision < _HUGE_PRECISION
    score = len(log_y) * math.log(noise) + 0.5 * float(theta[free] @ (precision[free] * theta[free]))
    return theta, np.linalg.inv(hess), noise, score


def _starts(tc: np.ndarray, tm: np.ndarray, to: np.ndarray, log_y: np.ndarray, fixed: np.ndarray) -> list[np.ndarray]:
    """Start points: the prior, and for each free term the scale that alone best explains the steps.

    The roofline's max makes the posterior multi-modal (a gap on decode steps can be closed by the
    memory or by the overhead scale); Gauss-Newton from several starts keeps the best optimum. The
    one-term starts come from a grid over ``log k`` in [-4, 8] minimising the median absolute residual.
    """
    starts = [np.zeros(3)]
    grid = np.linspace(-4.0, 8.0, 97)
    for j in range(3):
        if fixed[j]:
            continue
        best, best_err = 0.0, math.inf
        for g in grid:
            th = np.zeros(3)
            th[j] = g
            pred, _ = _jacobian(th, tc, tm, to)
            err = float(np.median(np.abs(np.log(pred) - log_y)))
            if err < best_err:
                best, best_err = g, err
        if best != 0.0:
            th = np.zeros(3)
            th[j] = best
            starts.append(th)
    return starts


def fit_time_scales(tc: np.ndarray, tm: np.ndarray, to: np.ndarray, measured_ms: np.ndarray,
                    settings: FitSettings | None = None) -> TimeScaleFit:
    """Fit one device's time scales ``(compute, memory, overhead)`` to its observed steps.

    Args:
        tc, tm, to: ``(n, num_classes)`` unit terms of each step at the prior (ms), from
            :func:`~flexpipe_dag.calibration.work.roofline_terms`.
        measured_ms: ``(n,)`` measured step times, ms (> 0).
        settings: priors and thresholds (:class:`FitSettings`).

    Raises:
        ValueError: shapes disagree or a measured time is not positive.
    """
    s = settings or FitSettings()
    y = np.asarray(measured_ms, dtype=float)
    n = len(y)
    if not (tc.shape == tm.shape == to.shape and tc.shape[0] == n):
        raise ValueError(f"shapes disagree: tc {tc.shape}, tm {tm.shape}, to {to.shape}, measured {y.shape}")
    if n and not np.all(y > 0):
        raise ValueError("measured_ms: every step time must be > 0")
    prior_sd = np.asarray(s.prior_sd, dtype=float)
    ones = {t: 1.0 for t in TERMS}
    before = float(np.median(np.abs(predict_terms_ms(tc, tm, to) - y) / y)) if n else math.nan
    if n < s.min_observations:
        return TimeScaleFit(ones, dict(zip(TERMS, prior_sd.tolist())), {t: False for t in TERMS},
                            {t: 0.0 for t in TERMS}, n, 0, 0, math.nan, False, before, before,
                            [f"{n} observed steps < {s.min_observations}: profile kept"])
    log_y = np.log(y)
    keep = np.ones(n, dtype=bool)
    fixed = np.zeros(3, dtype=bool)
    sd_when_fixed = np.zeros(3)
    notes: list[str] = []
    for _ in range(4):  # fit, fix unidentified terms, reject outliers, refit
        precision = np.where(fixed, _HUGE_PRECISION, 1.0 / prior_sd**2)
        args = (tc[keep], tm[keep], to[keep], log_y[keep])
        theta, cov, noise, _ = min((_map_fit(*args, precision, s, th0) for th0 in _starts(*args, fixed)),
                                   key=lambda fit: fit[3])
        sd = np.sqrt(np.diag(cov))
        newly_fixed = (~fixed) & (sd > s.identified_ratio * prior_sd)
        pred_all, _ = _jacobian(theta, tc, tm, to)
        r_all = np.log(pred_all) - log_y
        new_keep = np.abs(r_all) <= s.reject_sigma * noise
        if new_keep.sum() < s.min_observations:
            new_keep = keep
        if not newly_fixed.any() and np.array_equal(new_keep, keep):
            break
        sd_when_fixed[newly_fixed] = sd[newly_fixed]
        fixed |= newly_fixed
        keep = new_keep
    for i, t in enumerate(TERMS):
        if fixed[i]:
            notes.append(f"{t} scale not identified by these steps (posterior sd {sd_when_fixed[i]:.2f} vs prior "
                         f"{prior_sd[i]:.2f}): kept at the profile")
    sd = np.where(fixed, prior_sd, sd)
    scales = {t: (1.0 if fixed[i] else float(math.exp(theta[i]))) for i, t in enumerate(TERMS)}
    after = float(np.median(np.abs(predict_terms_ms(tc, tm, to, *(1 / scales[t] for t in TERMS)) - y) / y))
    return TimeScaleFit(
        scales=scales, log_sd=dict(zip(TERMS, sd.tolist())), identified={t: not fixed[i] for i, t in enumerate(TERMS)},
        confidence={t: float(max(0.0, 1.0 - sd[i] / prior_sd[i])) for i, t in enumerate(TERMS)},
        num_observations=n, num_used=int(keep.sum()), num_rejected=int(n - keep.sum()),
        noise_log_sd=float(noise), fitted=True, median_ape_before=before, median_ape_after=after, notes=notes)
