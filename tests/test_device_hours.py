"""Device accounting of a run's gear timeline: holds, union of devices during overlaps, device-hours."""

from __future__ import annotations

import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.sim import LinearStageTiming, ShiftEvent, manual_gear, simulate_schedule
from flexpipe_dag.sim.device_hours import GearHold, device_hours, device_spans, device_usage, gear_holds
from flexpipe_dag.workload import load_trace, time_window

DEVICES = {"big": ["a", "b", "c", "d"], "small": ["a", "b"], "other": ["e"]}


def test_static_run_holds_its_devices_for_the_whole_horizon():
    use = device_usage("big", [], DEVICES, end_s=7200.0)
    assert use.holds == (GearHold("big", 0.0, 7200.0),)
    assert use.device_hours == pytest.approx(4 * 2.0)
    assert use.peak_devices == 4 and use.mean_devices == pytest.approx(4.0)
    assert use.per_device_hour(800) == pytest.approx(100.0)


def test_shift_holds_both_gears_during_warm_up_and_drain_counting_shared_devices_once():
    # big serves 0..1000, warm-up of "other" 1000..1010, old drains until 1030; then "other" to 3600
    shifts = [ShiftEvent(1000.0, 1010.0, "big", "other", 1030.0)]
    use = device_usage("big", shifts, DEVICES, end_s=3600.0)
    assert use.holds == (GearHold("big", 0.0, 1030.0), GearHold("other", 1000.0, 3600.0))
    assert [(s.start_s, s.end_s, s.num_devices) for s in use.spans] == [
        (0.0, 1000.0, 4), (1000.0, 1030.0, 5), (1030.0, 3600.0, 1)]
    assert use.device_hours == pytest.approx((4 * 1000 + 5 * 30 + 1 * 2570) / 3600)
    assert use.peak_devices == 5
    # shrinking onto a subset of the same devices: the overlap holds the old gear's 4, not 4 + 2
    sub = device_usage("big", [ShiftEvent(1000.0, 1010.0, "big", "small", 1030.0)], DEVICES, end_s=3600.0)
    assert sub.device_hours == pytest.approx((4 * 1030 + 2 * 2570) / 3600)
    assert sub.peak_devices == 4


def test_round_trip_and_still_draining_at_the_end():
    shifts = [ShiftEvent(1800.0, 1805.0, "small", "big", None), ShiftEvent(600.0, 600.0, "big", "small", 610.0)]
    # unordered input; the second shift's old gear (small) is still draining at end_s: held to the end
    holds = gear_holds("big", shifts, end_s=3600.0)
    assert holds == [GearHold("big", 0.0, 610.0), GearHold("small", 600.0, 3600.0), GearHold("big", 1800.0, 3600.0)]
    spans = device_spans(holds, DEVICES)
    assert device_hours(spans) == pytest.approx((4 * 600 + 4 * 10 + 2 * 1190 + 4 * 1800) / 3600)


def test_intervals_are_clipped_to_the_horizon():
    holds = gear_holds("big", [ShiftEvent(50.0, 60.0, "big", "small", 500.0)], start_s=100.0, end_s=200.0)
    assert holds == [GearHold("big", 100.0, 200.0), GearHold("small", 100.0, 200.0)]


@pytest.mark.parametrize("shifts, kwargs, field", [
    ([], dict(end_s=-1.0), "end_s"),
    ([], dict(end_s=float("nan")), "end_s"),
    ([ShiftEvent(10.0, 5.0, "big", "small", None)], dict(end_s=100.0), "shifts[0].switched_s"),
    ([ShiftEvent(10.0, 20.0, "big", "small", 15.0)], dict(end_s=100.0), "shifts[0].drained_s"),
    ([ShiftEvent(10.0, 20.0, "small", "big", None)], dict(end_s=100.0), "shifts[0].from_gear_id"),
])
def test_bad_timelines_are_named(shifts, kwargs, field):
    with pytest.raises(InputError) as err:
        gear_holds("big", shifts, **kwargs)
    assert err.value.field == field


def test_unknown_gear_is_named():
    with pytest.raises(InputError, match="'nope' has no device list"):
        device_spans([GearHold("nope", 0.0, 1.0)], DEVICES)


def test_accounts_a_simulated_shift():
    timing = LinearStageTiming.uniform(2, prefill_fixed_ms=2, prefill_per_token_ms=0.02, decode_fixed_ms=8,
                                       decode_per_seq_ms=0.2, transfer_fixed_ms=0.5)
    small = manual_gear([16, 16], gear_id="g-small", micro_batch_size=16, max_inflight_micro_batches=2,
                        kv_capacity_tokens=200_000)
    w = time_window(load_trace("azure-conv"), 0, 120)
    res = simulate_schedule(w, [(0.0, small, timing), (60.0, small.model_copy(update={"gear_id": "g-b"}), timing)],
                            ready_in_s=3.0)
    devices = {"g-small": ["x", "y"], "g-b": ["y", "z"]}
    end_s = float(res.requests["finish_s"].max())
    use = device_usage("g-small", res.shifts, devices, end_s=end_s)
    (shift,) = res.shifts
    assert use.holds[0].end_s == shift.drained_s and use.holds[1].start_s == 60.0
    overlap = shift.drained_s - 60.0
    assert use.device_hours == pytest.approx((2 * end_s + overlap) / 3600)


# -- planner: operating gears chosen by goodput per device -------------------------------------------
def _toy_candidates():
    """Two-token requests (one prefill, one decode step). Capacities: roomy = wide ~14 req/s (wide
    adds a free stage on 2 more devices), quick2 ~9 req/s on 2 devices (free second stage), slow1
    ~7.7 req/s on 1 device, with decode steps of 40 / 40 / 10 / 30 ms."""
    from flexpipe_dag.sim import StageCosts

    free = StageCosts()
    gears = {
        "candidate-roomy": manual_gear([4], replicas=[2], gear_id="candidate-roomy", max_inflight_micro_batches=2),
        "candidate-wide": manual_gear([2, 2], replicas=[2, 2], gear_id="candidate-wide", max_inflight_micro_batches=2),
        "candidate-quick2": manual_gear([2, 2], gear_id="candidate-quick2", max_inflight_micro_batches=1),
        "candidate-slow1": manual_gear([4], gear_id="candidate-slow1", max_inflight_micro_batches=1),
    }
    timings = {
        "candidate-roomy": LinearStageTiming([StageCosts(prefill_fixed_ms=100.0, decode_fixed_ms=40.0)]),
        "candidate-wide": LinearStageTiming([StageCosts(prefill_fixed_ms=100.0, decode_fixed_ms=40.0), free]),
        "candidate-quick2": LinearStageTiming([StageCosts(prefill_fixed_ms=100.0, decode_fixed_ms=10.0), free]),
        "candidate-slow1": LinearStageTiming([StageCosts(prefill_fixed_ms=100.0, decode_fixed_ms=30.0)]),
    }
    return list(gears.values()), timings


@pytest.mark.parametrize("objective, expected", [
    # speed: throughput = the highest envelope (roomy and wide tie; the id breaks it), latency = lowest TPOT
    ("speed", [("latency", "latency-quick2"), ("throughput", "throughput-wide")]),
    # devices: the tie goes to the fewer devices, latency = the fewest devices holding the low load,
    # balanced = the most envelope per device strictly between the two
    ("devices", [("latency", "latency-slow1"), ("balanced", "balanced-quick2"), ("throughput", "throughput-roomy")]),
])
def test_select_operating_gears_by_goodput_per_device(objective, expected):
    from flexpipe_dag.planner.envelope import SelectionSettings, select_operating_gears
    from flexpipe_dag.workload.request import Request, Workload

    trace = Workload("two-token", tuple(Request(f"r{i}", float(i), 1, 2) for i in range(400)))
    candidates, timings = _toy_candidates()
    settings = SelectionSettings(slo_ttft_ms=400.0, slo_tpot_ms=1000.0, num_requests=400, rel_tol=0.02)
    gears = select_operating_gears(candidates, lambda g: timings[g.gear_id], trace, settings, objective=objective).gears
    assert [(g.kind, g.gear_id) for g in gears] == expected
    caps = [g.rps_max for g in gears]
    assert caps == sorted(caps)


def test_select_operating_gears_rejects_an_unknown_objective():
    from flexpipe_dag.planner.envelope import select_operating_gears

    candidates, timings = _toy_candidates()
    with pytest.raises(InputError, match="objective"):
        select_operating_gears(candidates, lambda g: timings[g.gear_id], load_trace("azure-conv"), objective="cheap")


def test_candidate_gears_add_compact_plans_that_fit_their_devices():
    from pathlib import Path

    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.planner.gears import candidate_gears
    from flexpipe_dag.planner.model_spec import ModelSpec
    from flexpipe_dag.planner.verify import gear_problems

    openb = load_cluster_profile(Path(__file__).resolve().parents[1] / "examples/clusters/alibaba_openb.yaml")
    spec = ModelSpec.from_builtin("Llama-2-7B")
    plain = candidate_gears(openb, spec, compact=False)
    both = candidate_gears(openb, spec)
    assert both[:len(plain)] == plain
    extra = both[len(plain):]
    # 64 sequences x 4096 tokens of KV need 7+ of these 16-32 GB cards; fewer sequences need fewer
    assert min(len(g.device_ids) for g in plain) >= 7
    sizes = [len(g.device_ids) for g in extra]
    assert extra and sizes == sorted(sizes, reverse=True) and sizes[0] < min(len(g.device_ids) for g in plain)
    assert len({g.gear_id for g in both}) == len(both)
    for g in extra:
        assert g.kind == "manual" and g.gear_id.startswith("candidate-")
        assert gear_problems(g, openb, spec) == []
