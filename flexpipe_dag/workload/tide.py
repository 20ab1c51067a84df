"""The daily tide: ServeGen's per-client request rates summed into one rate series, and arrivals that follow it.

Source data: alibaba/ServeGen ``m_small`` (Apache-2.0): 43 files ``chunk-N-trace.csv``, one per
client, no header, columns ``timestamp_s,rate_req_per_s,cv,arrival_dist,param1,param2``, one row
per 600 s window over 14 days (an empty ``arrival_dist`` means no traffic). The total request rate
of window ``w`` is the sum of ``rate_req_per_s`` over clients (:func:`aggregate_servegen_rates`).
The bundled ``servegen_tide_14d.csv`` is that sum (``window_start_s,total_rate_req_per_s``).

Time compression ``c`` maps tide time ``start_s + c * tau`` to workload time ``tau``: with
``c = 86400 / 3600`` one tide day plays in one simulated hour. Rates are rescaled separately
(``mean_rps``), because a compressed tide keeps its *shape*, not its absolute load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from flexpipe_dag.core.errors import InputError, shown
from flexpipe_dag.workload.files import read_user_frame
from flexpipe_dag.workload.request import Request, Workload

SERVEGEN_COLUMNS = ("timestamp_s", "rate_req_per_s", "cv", "arrival_dist", "param1", "param2")
TIDE_COLUMNS = ("window_start_s", "total_rate_req_per_s")


@dataclass(frozen=True)
class Tide:
    """A piecewise-constant request rate: ``rates_rps[k]`` holds over ``[k*window_s, (k+1)*window_s)``.

    Attributes:
        window_s: window length, seconds (ServeGen: 600).
        rates_rps: shape ``(num_windows,)``, requests per second, >= 0.
    """

    window_s: float
    rates_rps: np.ndarray
    source: str = ""

    @property
    def duration_s(self) -> float:
        return self.window_s * len(self.rates_rps)

    def rate_at(self, t_s: np.ndarray | float) -> np.ndarray:
        """Rate at tide time ``t_s`` (wraps around past the end)."""
        k = (np.asarray(t_s, dtype=float) // self.window_s).astype(np.int64) % len(self.rates_rps)
        return self.rates_rps[k]

    def daily_profile(self) -> np.ndarray:
        """Mean rate per window of the day over all whole days, shape ``(86400 / window_s,)``."""
        per_day = int(round(86400 / self.window_s))
        days = len(self.rates_rps) // per_day
        if days == 0:
            raise InputError(self.source, None, f"tide covers {self.duration_s} s; a daily profile needs at least one day")
        profile: np.ndarray = self.rates_rps[: days * per_day].reshape(days, per_day).mean(axis=0)
        return profile

    def without_days(self, days: Iterable[int]) -> Tide:
        """The same history with whole days removed (e.g. the day a benchmark replays, so its forecast
        does not see the future); the remaining days keep their order.

        Raises:
            InputError: a day outside the history, or no whole day left.
        """
        per_day = int(round(86400 / self.window_s))
        total = len(self.rates_rps) // per_day
        drop = set(days)
        bad = sorted(d for d in drop if not 0 <= d < total)
        if bad:
            raise InputError(self.source, "day", f"days {bad} are outside the history's {total} whole days")
        keep = [d for d in range(total) if d not in drop]
        if not keep:
            raise InputError(self.source, "day", "removing these days leaves no whole day")
        rates = np.concatenate([self.rates_rps[d * per_day:(d + 1) * per_day] for d in keep])
        return Tide(window_s=self.window_s, rates_rps=rates, source=f"{self.source} without day(s) {sorted(drop)}")


def _chunk_key(path: Path) -> tuple[int, str]:
    m = re.search(r"(\d+)", path.stem)
    return (int(m.group(1)) if m else -1, path.name)


def aggregate_servegen_rates(paths: Iterable[str | Path]) -> pd.DataFrame:
    """Sum ServeGen per-client rate series into the total rate per window.

    Args:
        paths: the per-client ``chunk-N-trace.csv`` files (no header).

    Returns:
        DataFrame ``window_start_s`` (int, s), ``total_rate_req_per_s`` (float), one row per window,
        sorted; windows a client lacks count as 0 for it.

    Raises:
        InputError: no files, an empty file, a non-numeric or negative rate / timestamp.
    """
    files = sorted((Path(p) for p in paths), key=_chunk_key)
    if not files:
        raise InputError(None, "paths", "no ServeGen chunk files given; expected chunk-N-trace.csv files")
    parts = []
    for f in files:
        d = read_user_frame(f, "ServeGen chunk (rows timestamp_s,rate_req_per_s,cv,arrival_dist,param1,param2)",
                            header=None, names=list(SERVEGEN_COLUMNS), usecols=[0, 1])
        for col in ("timestamp_s", "rate_req_per_s"):
            v = pd.to_numeric(d[col], errors="coerce")
            bad = v.isna() | (v < 0)
            if bad.any():
                i = int(np.flatnonzero(bad.to_numpy())[0])
                raise InputError(str(f), f"row {i + 1}.{col}", f"got {shown(d[col].iloc[i])}; expected a number >= 0")
            d[col] = v
        parts.append(d)
    total = pd.concat(parts).groupby("timestamp_s", sort=True)["rate_req_per_s"].sum()
    return pd.DataFrame({"window_start_s": total.index.astype(np.int64), "total_rate_req_per_s": total.to_numpy()})


def tide_from_frame(frame: pd.DataFrame, source: str = "") -> Tide:
    """A :class:`Tide` from ``window_start_s,total_rate_req_per_s`` rows (equally spaced windows).

    Raises:
        InputError: fewer than 2 rows, uneven spacing, negative rate.
    """
    for c in TIDE_COLUMNS:
        if c not in frame.columns:
            raise InputError(source, c, f"column missing; expected columns {list(TIDE_COLUMNS)}")
    if len(frame) < 2:
        raise InputError(source, None, "expected at least 2 windows")
    starts = frame["window_start_s"].to_numpy(dtype=float)
    steps = np.diff(starts)
    if steps[0] <= 0 or not np.allclose(steps, steps[0]):
        i = int(np.flatnonzero(~np.isclose(steps, steps[0]))[0] + 1) if steps[0] > 0 else 1
        raise InputError(source, f"row {i + 1}.window_start_s", f"windows must be equally spaced and increasing (first step {steps[0]} s)")
    rates = frame["total_rate_req_per_s"].to_numpy(dtype=float)
    if (rates < 0).any() or not np.isfinite(rates).all():
        i = int(np.flatnonzero((rates < 0) | ~np.isfinite(rates))[0])
        raise InputError(source, f"row {i + 1}.total_rate_req_per_s", f"got {rates[i]}; expected a rate >= 0")
    return Tide(window_s=float(steps[0]), rates_rps=rates, source=source)


def load_tide(path: str | Path) -> Tide:
    """Load a pre-aggregated tide CSV (``window_start_s,total_rate_req_per_s``)."""
    path = Path(path)
    return tide_from_frame(read_user_frame(path, "tide CSV (window_start_s,total_rate_req_per_s)"), source=str(path))


def _cumulative(tide: Tide, compression: float, start_s: float, duration_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Knots ``(tau_s, Lambda)`` of the cumulative relative rate over workload time ``[0, duration_s]``.

    ``Lambda`` is the integral of ``tide.rate_at(start_s + compression * tau)`` d tau, piecewise linear.
    """
    if compression <= 0:
        raise InputError(tide.source, "compression", f"got {compression}; expected > 0")
    if duration_s <= 0:
        raise InputError(tide.source, "duration_s", f"got {duration_s}; expected > 0")
    w = tide.window_s
    t0, t1 = start_s, start_s + compression * duration_s
    edges = np.arange(np.floor(t0 / w) * w + w, t1, w)
    tide_t = np.concatenate([[t0], edges, [t1]])
    rates = tide.rate_at(tide_t[:-1])
    lam = np.concatenate([[0.0], np.cumsum(rates * np.diff(tide_t) / compression)])
    return (tide_t - t0) / compression, lam


def _scale(lam_total: float, duration_s: float, mean_rps: float | None, peak_rps: float | None, peak_raw: float, source: str) -> float:
    if lam_total <= 0:
        raise InputError(source, None, "the tide has no traffic over the chosen span")
    if mean_rps is not None and peak_rps is not None:
        raise InputError(source, "mean_rps", "give mean_rps or peak_rps, not both")
    if peak_rps is not None:
        return peak_rps / peak_raw
    return (mean_rps if mean_rps is not None else lam_total / duration_s) * duration_s / lam_total


def tide_arrivals(
    tide: Tide,
    lengths: Workload,
    *,
    duration_s: float,
    compression: float,
    start_s: float = 0.0,
    mean_rps: float | None = None,
    peak_rps: float | None = None,
    seed: int = 0,
    klass: str = "online",
    name: str = "tide",
) -> Workload:
    """Poisson arrivals whose rate follows the (compressed) tide; lengths drawn from ``lengths``.

    Rate at workload time ``tau``: ``lambda(tau) = s * tide.rate_at(start_s + compression * tau)``;
    ``s`` makes the mean ``mean_rps`` (or the peak ``peak_rps``); with neither, ``s = 1 / compression``
    so the same *number* of requests as the tide's span arrive, compressed. Arrival times are a
    non-homogeneous Poisson process (unit-rate exponential gaps mapped through the inverse cumulative
    rate); the superposition of many clients' renewal processes tends to Poisson (Palm-Khintchine).
    Lengths are ``lengths.requests`` sampled with replacement. Deterministic for a given ``seed``.

    Raises:
        InputError: compression / duration <= 0, empty ``lengths``, a tide span with no traffic.
    """
    if len(lengths) == 0:
        raise InputError(lengths.source or lengths.name, None, "length source has no requests")
    tau, lam = _cumulative(tide, compression, start_s, duration_s)
    raw_peak = float(tide.rate_at(start_s + compression * tau[:-1]).max())
    if mean_rps is None and peak_rps is None:
        s = 1.0 / compression
    else:
        s = _scale(lam[-1], duration_s, mean_rps, peak_rps, raw_peak, tide.source)
    rng = np.random.default_rng(seed)
    total = lam[-1] * s
    n = int(rng.poisson(total))
    u = np.sort(rng.uniform(0.0, total, size=n))  # given N, Poisson points are iid uniform in Lambda
    t = np.interp(u, lam * s, tau)
    picks = rng.integers(0, len(lengths), size=n)
    src = lengths.requests
    reqs = tuple(
        Request(f"{name}-{i:06d}", float(t[i]), src[j].input_tokens, src[j].output_tokens, klass, 0)  # type: ignore[arg-type]
        for i, j in enumerate(picks)
    )
    return Workload(name=name, requests=reqs, source=tide.source,
                    meta={"compression": compression, "start_s": start_s, "seed": seed, "scale": s})


def shape_by_tide(
    workload: Workload,
    tide: Tide,
    *,
    compression: float,
    start_s: float = 0.0,
    duration_s: float | None = None,
    mean_rps: float | None = None,
    peak_rps: float | None = None,
    name: str | None = None,
) -> Workload:
    """Time-warp a real trace so its local arrival rate follows the tide; lengths and order are kept.

    Each arrival ``a_i`` becomes operational time ``u_i = a_i * m`` (``m`` = the trace's mean rate)
    and then ``t_i = Lambda^-1(u_i)``, where ``Lambda`` is the cumulative target rate
    ``s * tide.rate_at(start_s + compression * tau)`` (a random time change, as in Cinlar's
    construction of non-homogeneous processes). Burstiness of the trace is preserved, scaled by the
    local rate. If the target needs more requests than the trace holds, the trace is replayed
    again (ids get ``~k``). Deterministic, no randomness.

    Args:
        compression: tide seconds per workload second (``86400 / duration_s`` plays a day).
        duration_s: workload span (default: the trace's own span).
        mean_rps / peak_rps: target mean or peak rate (default: the trace's mean rate).

    Raises:
        InputError: a trace with fewer than 2 requests, compression / duration <= 0, no traffic.
    """
    if len(workload) < 2 or workload.duration_s <= 0:
        raise InputError(workload.source or workload.name, None, "needs at least two requests at different times to shape")
    duration = float(duration_s if duration_s is not None else workload.duration_s)
    tau, lam = _cumulative(tide, compression, start_s, duration)
    raw_peak = float(tide.rate_at(start_s + compression * tau[:-1]).max())
    if mean_rps is None and peak_rps is None:
        mean_rps = workload.mean_rate_rps
    s = _scale(lam[-1], duration, mean_rps, peak_rps, raw_peak, tide.source)
    lam_s = lam * s
    base = workload.requests
    arrivals = np.array([r.arrival_s for r in base])
    m = (len(base) - 1) / workload.duration_s
    u_base = (arrivals - arrivals[0]) * m
    period_u = float(len(base))  # operational length of one replay (one mean gap after the last request)
    replays = int(np.ceil(lam_s[-1] / period_u))
    u_all = np.concatenate([u_base + k * period_u for k in range(max(replays, 1))])
    keep = u_all < lam_s[-1]
    t = np.interp(u_all[keep], lam_s, tau)
    idx = np.flatnonzero(keep)
    reqs = tuple(
        Request(base[i % len(base)].request_id if i < len(base) else f"{base[i % len(base)].request_id}~{i // len(base)}",
                float(ti), base[i % len(base)].input_tokens, base[i % len(base)].output_tokens,
                base[i % len(base)].klass, base[i % len(base)].priority)
        for i, ti in zip(idx.tolist(), t.tolist())
    )
    k = replays - 1
    return Workload(name=name or f"{workload.name}@tide", requests=reqs, source=workload.source,
                    meta={"compression": compression, "start_s": start_s, "scale": s, "replays": k + 1})
