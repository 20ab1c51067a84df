"""The ServeGen tide: aggregation, bundled series, tide-following arrivals and trace shaping."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.workload import (
    aggregate_servegen_rates,
    bundled_path,
    load_tide,
    load_tide_trace,
    load_trace,
    shape_by_tide,
    tide_arrivals,
)

#: ServeGen's raw per-client chunks are not in the repo (the bundled tide is their aggregate): the
#: provenance check runs only where this variable names a directory of ``chunk-N-trace.csv`` files.
RAW_ENV = "FLEXPIPE_SERVEGEN_RAW_DIR"


def test_bundled_tide_is_14_days_of_600s_windows():
    tide = load_tide_trace()
    assert tide.window_s == 600 and len(tide.rates_rps) == 14 * 144
    prof = tide.daily_profile()
    assert prof.shape == (144,)
    assert prof.max() / prof.min() > 2.0  # a real diurnal swing


def test_bundled_tide_is_the_aggregate_of_its_clients(tmp_path):
    """The bundled series split over clients in ServeGen's raw chunk layout (one client missing the
    second half) aggregates back to itself: the file and the aggregation agree (bundled data only)."""
    bundled = pd.read_csv(bundled_path("servegen-tide"))
    t, total = bundled["window_start_s"].to_numpy(), bundled["total_rate_req_per_s"].to_numpy()
    half = len(t) // 2
    shares = [np.r_[np.full(half, 0.5), np.full(len(t) - half, 0.8)], np.full(len(t), 0.2), np.full(half, 0.3)]
    for k, share in enumerate(shares):  # no header: timestamp_s,rate_req_per_s,cv,arrival_dist,param1,param2
        rows = [f"{t[i]},{float(share[i] * total[i])!r},1.0,Gamma,1.0,1.0" for i in range(len(share))]
        (tmp_path / f"chunk-{k}-trace.csv").write_text("\n".join(rows) + "\n")
    frame = aggregate_servegen_rates(sorted(tmp_path.glob("chunk-*-trace.csv")))
    assert frame["window_start_s"].tolist() == t.tolist()
    np.testing.assert_allclose(frame["total_rate_req_per_s"].to_numpy(), total, rtol=1e-12)
    np.testing.assert_allclose(load_tide(bundled_path("servegen-tide")).rates_rps, total, rtol=1e-12)


@pytest.mark.skipif(not os.environ.get(RAW_ENV), reason=f"set {RAW_ENV} to ServeGen's raw m_small chunks (not "
                                                       "bundled) to re-check the bundled tide's provenance")
def test_bundled_tide_reproduces_from_raw_chunks():
    raw = Path(os.environ[RAW_ENV])
    frame = aggregate_servegen_rates(sorted(raw.glob("chunk-*-trace.csv")))
    bundled = load_tide(bundled_path("servegen-tide"))
    np.testing.assert_allclose(frame["total_rate_req_per_s"].to_numpy(), bundled.rates_rps, atol=1e-5)


def test_aggregate_sums_clients(tmp_path):
    (tmp_path / "chunk-0-trace.csv").write_text("0,1.5,1,Gamma,1,1\n600,0,0,,0,0\n")
    (tmp_path / "chunk-1-trace.csv").write_text("0,2.0,1,Gamma,1,1\n600,3.0,1,Weibull,1,1\n")
    frame = aggregate_servegen_rates(sorted(tmp_path.glob("*.csv")))
    assert frame["total_rate_req_per_s"].tolist() == [3.5, 3.0]
    (tmp_path / "chunk-2-trace.csv").write_text("0,-1,1,Gamma,1,1\n")
    with pytest.raises(InputError, match="row 1.rate_req_per_s"):
        aggregate_servegen_rates(sorted(tmp_path.glob("*.csv")))


def test_tide_arrivals_follow_the_tide_and_are_seeded():
    tide = load_tide_trace()
    lengths = load_trace("azure-conv")
    kw = dict(duration_s=3600.0, compression=24.0, mean_rps=20.0)
    a = tide_arrivals(tide, lengths, seed=7, **kw)
    b = tide_arrivals(tide, lengths, seed=7, **kw)
    c = tide_arrivals(tide, lengths, seed=8, **kw)
    assert a.requests == b.requests and a.requests != c.requests
    assert len(a) / 3600 == pytest.approx(20.0, rel=0.03)
    # per compressed window (600 s of tide = 25 s here) the count tracks the tide's rate
    t = np.array([r.arrival_s for r in a.requests])
    counts, _ = np.histogram(t, bins=144, range=(0, 3600))
    expected = tide.rates_rps[:144]
    assert np.corrcoef(counts, expected)[0, 1] > 0.9


def test_shape_by_tide_keeps_lengths_and_follows_rate():
    w = load_trace("azure-conv")
    tide = load_tide_trace()
    shaped = shape_by_tide(w, tide, compression=86400 / w.duration_s)
    assert abs(len(shaped) - len(w)) <= 2  # same mean rate, same span
    assert [r.input_tokens for r in shaped.requests[:100]] == [r.input_tokens for r in w.requests[:100]]
    t = np.array([r.arrival_s for r in shaped.requests])
    assert np.all(np.diff(t) >= 0)
    counts, _ = np.histogram(t, bins=24, range=(0, w.duration_s))
    hourly = tide.rates_rps[:144].reshape(24, 6).mean(axis=1)
    # the trace keeps its own bursts, so the match is looser than for Poisson arrivals
    assert np.corrcoef(counts, hourly)[0, 1] > 0.7
    more = shape_by_tide(w, tide, compression=86400 / w.duration_s, mean_rps=2 * w.mean_rate_rps)
    assert len(more) == pytest.approx(2 * len(w), rel=0.02)
    assert len({r.request_id for r in more}) == len(more)


def test_bad_compression():
    with pytest.raises(InputError, match="compression"):
        tide_arrivals(load_tide_trace(), load_trace("azure-code"), duration_s=10, compression=0)


def test_peak_rate_is_the_busiest_window_and_the_mean_when_shorter_than_one():
    from flexpipe_dag.workload import Request, Workload

    def wl(arrivals):
        return Workload.from_requests([Request(f"r{i}", t, 8, 4) for i, t in enumerate(arrivals)], "w")

    burst = wl([0.0, 1.0, 2.0, 10.0, 10.5, 11.0, 11.5, 12.0, 30.0])  # 5 arrivals within [10, 12]
    assert burst.peak_rate_rps(5.0) == pytest.approx(5 / 5.0)
    assert burst.peak_rate_rps(1.0) == pytest.approx(2 / 1.0)  # a window is half-open: 10.0 and 10.5
    short = wl([0.0, 1.0, 2.0])
    assert short.peak_rate_rps(60.0) == pytest.approx(short.mean_rate_rps)
    with pytest.raises(ValueError, match="window_s"):
        burst.peak_rate_rps(0.0)
