"""Gear evaluation on a reference workload (what the gear_evaluations asset stores)."""

from __future__ import annotations

from flexpipe_dag.sim import LinearStageTiming, StageCosts, evaluate_gear, manual_gear, plot_evaluation, simulate
from flexpipe_dag.workload import Workload, load_trace, time_window


def test_evaluate_gear_estimate_cdf_and_plot(tmp_path):
    w = time_window(load_trace("azure-conv"), 0, 60)
    timing = LinearStageTiming([StageCosts(prefill_fixed_ms=1, prefill_per_token_ms=0.01, decode_fixed_ms=m) for m in (2, 6)])
    gear = manual_gear([10, 20], gear_id="g", micro_batch_size=16, max_inflight_micro_batches=2)
    ev = evaluate_gear(gear, timing, w)
    assert ev.estimate.bottleneck_stage == 1
    assert ev.estimate.ttft_p99_ms >= ev.estimate.ttft_p50_ms > 0
    assert len(ev.ttft_cdf_ms) == 101 and ev.ttft_cdf_ms == sorted(ev.ttft_cdf_ms)
    assert ev.to_dict()["summary"]["completed"] == len(w)
    png = plot_evaluation([ev], tmp_path / "ev.png")
    assert png.stat().st_size > 1000


def test_empty_workload():
    res = simulate(Workload.from_requests([], name="none"), manual_gear([1]), LinearStageTiming.uniform(1, prefill_fixed_ms=1))
    assert res.summary["requests"] == 0 and res.summary["completed"] == 0 and res.samples == []
