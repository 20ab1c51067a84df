"""Gear shifts with drain, metric samples (the controller's input), determinism under a seed."""

from __future__ import annotations

import numpy as np
import pytest

from flexpipe_dag.core.metrics import MetricSample
from flexpipe_dag.sim import LinearStageTiming, SimConfig, Simulator, manual_gear, simulate, simulate_schedule
from flexpipe_dag.workload import load_tide_trace, load_trace, tide_arrivals, time_window

SLOW = LinearStageTiming.uniform(2, prefill_fixed_ms=2, prefill_per_token_ms=0.02, decode_fixed_ms=8, decode_per_seq_ms=0.2,
                                 transfer_fixed_ms=0.5)
FAST = LinearStageTiming.uniform(4, prefill_fixed_ms=1, prefill_per_token_ms=0.01, decode_fixed_ms=3, decode_per_seq_ms=0.1,
                                 transfer_fixed_ms=0.3)


def _gears():
    old = manual_gear([16, 16], gear_id="g-old", micro_batch_size=16, max_inflight_micro_batches=2, kv_capacity_tokens=200_000)
    new = manual_gear([8, 8, 8, 8], gear_id="g-new", micro_batch_size=32, max_inflight_micro_batches=4, kv_capacity_tokens=400_000)
    return old, new


def test_shift_mid_run_drains_and_loses_nothing():
    w = time_window(load_trace("azure-conv"), 0, 300)
    old, new = _gears()
    res = simulate_schedule(w, [(0.0, old, SLOW), (150.0, new, FAST)], ready_in_s=5.0)
    df = res.requests
    assert res.summary["completed"] == len(w) and res.summary["unfinished"] == 0 and res.summary["rejected"] == 0
    assert df["request_id"].is_unique
    (shift,) = res.shifts
    assert (shift.requested_s, shift.switched_s) == (150.0, 155.0)
    assert shift.drained_s is not None and shift.drained_s >= 155.0
    assert set(df[df["arrival_s"] > 155.0]["gear_id"]) == {"g-new"}
    assert set(df[df["finish_s"] < 150.0]["gear_id"]) == {"g-old"}
    # a request running at the switch finishes on the old gear
    straddling = df[(df["first_token_s"] < 155.0) & (df["finish_s"] > 155.0)]
    assert len(straddling) > 0 and set(straddling["gear_id"]) == {"g-old"}
    gear_by_t = {s.t_s: s.gear_id for s in res.samples}
    assert gear_by_t[150.0] == "g-old" and gear_by_t[156.0] == "g-new"
    assert set(res.summary["stage_utilisation"]) == {"g-old", "g-new"}


def test_step_api_lets_a_controller_shift():
    w = time_window(load_trace("azure-code"), 0, 120)
    old, new = _gears()
    sim = Simulator(w, old, SLOW)
    seen: list[MetricSample] = []
    horizon_s = 120 + 3600  # the window, then an hour to drain: a simulation that never finishes fails here
    while not sim.finished:
        assert sim.now_s < horizon_s, f"the simulation had not finished at t={sim.now_s} s (simulated)"
        samples = sim.advance(sim.now_s + 2.0)
        seen.extend(samples)
        if sim.gear_id == "g-old" and samples and samples[-1].t_s >= 20:
            sim.shift_gear(new, FAST)
    res = sim.result()
    assert res.summary["completed"] == len(w) and res.summary["shifts"] == 1
    assert [s.t_s for s in seen[:3]] == [2.0, 4.0, 6.0]


def test_samples_every_period_and_consistent_with_results():
    w = time_window(load_trace("azure-conv"), 0, 200)
    old, _ = _gears()
    res = simulate(w, old, SLOW)
    ts = np.array([s.t_s for s in res.samples])
    assert np.allclose(np.diff(ts), 2.0) and ts[0] == 2.0
    assert sum(s.completed for s in res.samples) == len(w)
    assert sum(s.rps * 2.0 for s in res.samples) == pytest.approx(len(w))
    assert sum(s.tokens_per_s * 2.0 for s in res.samples) == pytest.approx(res.requests["output_tokens"].sum())
    for s in res.samples:
        assert s.source == "sim" and s.gear_id == "g-old" and len(s.stages) == 2
        assert all(0.0 <= st.busy_fraction <= 1.0 for st in s.stages)
        assert 0.0 <= s.kv_used_fraction <= 1.0
        assert MetricSample.from_dict(s.to_dict()) == s
    busy = np.mean([s.stages[0].busy_fraction for s in res.samples])
    assert busy == pytest.approx(res.summary["stage_utilisation"]["g-old"][0], rel=0.02)
    ts_frame = res.timeseries()
    assert {"queue_length", "kv_used_fraction", "stage0_busy"} <= set(ts_frame.columns)


def test_deterministic_under_a_seed():
    tide, lengths = load_tide_trace(), load_trace("azure-conv")
    old, _ = _gears()

    def run(seed):
        w = tide_arrivals(tide, lengths, duration_s=120, compression=720, mean_rps=6, seed=seed)
        return simulate(w, old, SLOW, SimConfig(slo_ttft_ms=500))

    a, b, c = run(11), run(11), run(12)
    assert a.requests.equals(b.requests) and a.samples == b.samples and a.summary == b.summary
    assert not a.requests["finish_s"].equals(c.requests["finish_s"])


def test_goodput_counts_slo_met():
    w = time_window(load_trace("azure-conv"), 0, 120)
    old, _ = _gears()
    strict = simulate(w, old, SLOW, SimConfig(slo_ttft_ms=1, slo_tpot_ms=1)).summary
    loose = simulate(w, old, SLOW, SimConfig(slo_ttft_ms=1e7, slo_tpot_ms=1e7)).summary
    assert strict["goodput_rps"] == 0.0
    assert loose["goodput_rps"] == pytest.approx(loose["throughput_rps"])
    assert loose["by_class"]["online"]["completed"] == len(w)


def test_queued_and_preempted_requests_move_to_the_new_gear():
    w = time_window(load_trace("azure-conv"), 0, 90)
    old = manual_gear([16, 16], gear_id="g-old", micro_batch_size=8, max_inflight_micro_batches=2, kv_capacity_tokens=20_000)
    _, new = _gears()
    res = simulate_schedule(w, [(0.0, old, SLOW), (45.0, new, FAST)])
    df = res.requests
    assert res.summary["unfinished"] == 0 and res.summary["completed"] + res.summary["rejected"] == len(w)
    moved = df[(df["arrival_s"] < 45.0) & (df["gear_id"] == "g-new")]
    assert len(moved) > 0  # waited (or were preempted) on the old gear, finished on the new one
    assert res.summary["preemptions"] > 0


def test_without_metric_samples_requests_and_utilisation_are_unchanged():
    """Envelope probes switch samples off: every per-request outcome and the stage utilisation stay the
    same (with and without a shift), only the samples and the summary's sample series go."""
    w = time_window(load_trace("azure-conv"), 0, 300)
    old, new = _gears()
    with_samples = simulate_schedule(w, [(0.0, old, SLOW), (150.0, new, FAST)], ready_in_s=5.0)
    without = simulate_schedule(w, [(0.0, old, SLOW), (150.0, new, FAST)], ready_in_s=5.0,
                                config=SimConfig(metric_samples=False))
    assert with_samples.samples and not without.samples
    assert without.requests.equals(with_samples.requests)
    assert without.summary["stage_utilisation"] == with_samples.summary["stage_utilisation"]
    assert without.shifts == with_samples.shifts
    assert without.summary["queue_length"] == {"mean": 0.0, "p95": 0.0, "max": 0.0}
