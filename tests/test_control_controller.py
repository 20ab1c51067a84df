"""The gear-shift controller: EMA, triggers with hysteresis, dwell escalation, payback, health, cursor."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flexpipe_dag.control import Controller, ControllerConfig, ControllerState, Decision
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import Gear, GearEstimate, StagePlan
from flexpipe_dag.core.metrics import MetricSample, StageSample

TARGET_MS = 1000.0


def make_gear(gear_id: str, kind: str, *, rps_min: float = 0.0, rps_max: float = math.inf,
              est_p99_ms: float | None = None, devices: tuple[str, ...] = ("d0", "d1")) -> Gear:
    n = len(devices)
    bounds = [round(30 * i / n) for i in range(n + 1)]
    stages = [StagePlan(stage_index=i, layer_start=bounds[i], layer_end=bounds[i + 1], device_ids=[d])
              for i, d in enumerate(devices)]
    estimate = None
    if est_p99_ms is not None:
        estimate = GearEstimate(throughput_rps=rps_max if math.isfinite(rps_max) else 100.0, tokens_per_s=0.0,
                                ttft_p50_ms=est_p99_ms / 2, ttft_p99_ms=est_p99_ms, tpot_p50_ms=20.0,
                                tpot_p99_ms=40.0, bottleneck_stage=0)
    return Gear(gear_id=gear_id, kind=kind, model_name="m", num_layers=30, stages=stages, rps_min=rps_min,
                rps_max=rps_max, target_p99_ms=TARGET_MS, estimate=estimate)


LAT = make_gear("lat", "latency", rps_min=0.0, rps_max=5.0, est_p99_ms=700.0)
BAL = make_gear("bal", "balanced", rps_min=2.0, rps_max=10.0, est_p99_ms=750.0, devices=("d0", "d1", "d2"))
THR = make_gear("thr", "throughput", rps_min=4.0, rps_max=20.0, est_p99_ms=800.0,
                devices=("d0", "d1", "d2", "d3"))
GEARS = [LAT, BAL, THR]


def sample(t_s: float, gear_id: str, *, rps: float = 3.0, p99_ms: float | None = 800.0,
           busy: tuple[float, ...] = (0.7, 0.7)) -> MetricSample:
    stages = tuple(StageSample(stage_index=i, busy_fraction=b, queue_length=0, kv_blocks_used=0,
                               kv_blocks_total=100) for i, b in enumerate(busy))
    return MetricSample(t_s=t_s, gear_id=gear_id, source="sim", rps=rps, completed=int(rps * 2),
                        tokens_per_s=rps * 100, queue_length=0, running=3, kv_used_fraction=0.3,
                        ttft_p50_ms=None if p99_ms is None else p99_ms / 2, ttft_p99_ms=p99_ms, stages=stages)


def feed(ctrl: Controller, state: ControllerState | None, gears, samples, **kw) -> tuple[ControllerState, list[Decision]]:
    """One decide() call per sample, as a sensor ticking every sample period would."""
    decisions = []
    for s in samples:
        state, d = ctrl.decide(state, [s], gears, **kw)
        decisions.append(d)
    return state, decisions


# --------------------------------------------------------------------------------------------- EMA
def test_ema_math_and_missing_latency():
    ctrl = Controller()
    st, _ = ctrl.decide(None, [sample(2, "lat", rps=10, p99_ms=400), sample(4, "lat", rps=20, p99_ms=None),
                               sample(6, "lat", rps=0, p99_ms=800)], GEARS)
    assert st.ema_rps == pytest.approx(0.3 * 0 + 0.7 * (0.3 * 20 + 0.7 * 10))  # 9.1
    assert st.ema_p99_ms == pytest.approx(0.3 * 800 + 0.7 * 400)  # None sample skipped
    assert st.samples_seen == 3 and st.last_sample_t_s == 6


def test_ema_alpha_is_configurable_and_stage_utilisation_is_per_stage():
    ctrl = Controller(ControllerConfig(ema_alpha=0.5))
    st, _ = ctrl.decide(None, [sample(2, "lat", busy=(0.2, 0.8)), sample(4, "lat", busy=(0.4, 0.6))], GEARS)
    assert st.ema_stage_busy == pytest.approx([0.3, 0.7])


def test_already_seen_samples_are_skipped():
    ctrl = Controller()
    st1, _ = ctrl.decide(None, [sample(2, "lat", rps=10)], GEARS)
    st2, _ = ctrl.decide(st1, [sample(2, "lat", rps=99), sample(1, "lat", rps=99)], GEARS)
    assert st2.ema_rps == st1.ema_rps and st2.samples_seen == 1


# -------------------------------------------------------------------------------- triggers, 3 samples
TRIGGER_CASES = {
    # trigger: (serving gear, sample kwargs, expected target)
    "rps_above_envelope": ("lat", dict(rps=8.0), "bal"),  # next gear up that holds the load
    "rps_below_envelope": ("thr", dict(rps=0.8), "bal2"),  # next gear down that holds 0.8/s (bal2 from 0.5/s)
    "latency_over": ("thr", dict(rps=4.5, p99_ms=1500.0), "lat"),
    "latency_under": ("lat", dict(rps=3.0, p99_ms=300.0), "bal2"),  # roomiest balanced gear
    "imbalance": ("bal", dict(rps=3.0, busy=(0.95, 0.4, 0.7)), "bal2"),
}


@pytest.mark.parametrize("trigger", list(TRIGGER_CASES))
def test_each_trigger_needs_three_samples(trigger):
    serving, kw, expected = TRIGGER_CASES[trigger]
    bal2 = make_gear("bal2", "balanced", rps_min=0.5, rps_max=12.0, est_p99_ms=750.0, devices=("d1", "d2", "d3"))
    gears = GEARS + [bal2]
    ctrl = Controller()
    st, ds = feed(ctrl, None, gears, [sample(2 * i, serving, **kw) for i in range(1, 4)])
    assert [d.action for d in ds] == ["hold", "hold", "shift"]
    assert ds[0].trigger == trigger and not ds[0].declined and "1 samples) of 3 needed" in ds[0].reason
    assert ds[1].trigger == trigger and "2 samples) of 3 needed" in ds[1].reason
    shift = ds[2]
    assert shift.trigger == trigger and shift.from_gear_id == serving and shift.to_gear_id == expected
    assert shift.reason.startswith(f"shift {serving}") and "> migration cost 30 s (default, not estimated)" in shift.reason
    assert shift.estimated_gain_fraction > 0 and shift.expected_residence_s == 1800.0
    assert st.pending_to_gear_id == expected and st.last_shift_s == 6 and st.shifts == 1


def test_hysteresis_count_is_configurable():
    ctrl = Controller(ControllerConfig(hysteresis_samples=5))
    _, ds = feed(ctrl, None, GEARS, [sample(2 * i, "lat", rps=8.0) for i in range(1, 6)])
    assert [d.action for d in ds] == ["hold"] * 4 + ["shift"]


def test_interrupted_condition_restarts_the_count():
    # EMA alpha 1 makes each sample the smoothed value: 2 on, 1 off, 2 on, 1 off ... never 3 in a row
    ctrl = Controller(ControllerConfig(ema_alpha=1.0))
    rps = [8, 8, 3] * 10
    st, ds = feed(ctrl, None, GEARS, [sample(2 * (i + 1), "lat", rps=q) for i, q in enumerate(rps)])
    assert all(d.action == "hold" for d in ds) and st.shifts == 0


def test_shift_is_pending_until_the_samples_show_the_new_gear():
    ctrl = Controller()
    st, ds = feed(ctrl, None, GEARS, [sample(2 * i, "lat", rps=8.0) for i in range(1, 6)])
    assert [d.action for d in ds] == ["hold", "hold", "shift", "hold", "hold"]
    assert "in progress" in ds[3].reason and st.pending_to_gear_id == "bal"
    st, d = ctrl.decide(st, [sample(12, "bal", rps=8.0, busy=(0.7,) * 3)], GEARS)
    assert st.gear_id == "bal" and st.pending_to_gear_id is None and st.counts == {} and d.action == "hold"
    assert st.residence_ema_s is None and st.gear_since_s == 12  # "lat" served since before we looked
    st, _ = ctrl.decide(st, [sample(700, "lat")], GEARS)
    # the first residence observed seeds the EMA: "bal" served from t=12 to t=700
    assert st.residence_ema_s == 700 - 12 and st.ema_p99_ms == 800.0 and st.ema_stage_busy == [0.7, 0.7]


def test_pending_shift_times_out_when_the_new_gear_never_serves():
    ctrl = Controller(ControllerConfig(shift_timeout_s=60.0, dwell_s=0.0))
    st, _ = feed(ctrl, None, GEARS, [sample(2 * i, "lat", rps=8.0) for i in range(1, 4)])
    st, ds = feed(ctrl, st, GEARS, [sample(6 + 2 * i, "lat", rps=8.0) for i in range(1, 35)])
    assert ds[0].action == "hold" and "in progress" in ds[0].reason
    retry = next(d for d in ds if d.action == "shift")
    assert "not seen serving after" in retry.reason and retry.t_s >= 66


def test_reverse_shift_needs_its_own_three_samples():
    # alpha 1: the smoothed value is the sample, so the counts are exact
    ctrl = Controller(ControllerConfig(dwell_s=0.0, ema_alpha=1.0))
    st, ds = feed(ctrl, None, GEARS, [sample(2 * i, "lat", rps=8.0) for i in range(1, 4)])
    assert ds[-1].to_gear_id == "bal"
    # the load drops at once; bal's very first samples already say "below envelope"
    st, ds = feed(ctrl, st, GEARS, [sample(6 + 2 * i, "bal", rps=1.0, busy=(0.5,) * 3) for i in range(1, 4)])
    assert [d.action for d in ds] == ["hold", "hold", "shift"]
    assert "(rps 1/s below envelope min 2, 1 samples) of 3 needed" in ds[0].reason
    assert ds[2].to_gear_id == "lat" and ds[2].trigger == "rps_below_envelope"


# ------------------------------------------------------------------------------------------- dwell
EXACT = ControllerConfig(ema_alpha=1.0)  # smoothed value = sample, so sample counts are exact


def _shift_to_bal(ctrl: Controller) -> ControllerState:
    st, ds = feed(ctrl, None, GEARS, [sample(2 * i, "lat", rps=8.0) for i in range(1, 4)])
    assert ds[-1].action == "shift" and ds[-1].to_gear_id == "bal" and ds[-1].t_s == 6
    st, _ = ctrl.decide(st, [sample(8, "bal", rps=8.0, busy=(0.7,) * 3)], GEARS)
    return st


def _bal(t_s: float, rps: float) -> MetricSample:
    return sample(t_s, "bal", rps=rps, busy=(0.7,) * 3)


def test_trigger_inside_dwell_is_declined_with_reason_and_raises_threshold():
    ctrl = Controller(EXACT)
    st = _shift_to_bal(ctrl)  # shift decided at t=6
    # 4.2 min after the shift the load falls below bal's envelope for 3 samples
    st, ds = feed(ctrl, st, GEARS, [_bal(t, 1.0) for t in (254, 256, 258)])
    d = ds[-1]
    assert d.action == "hold" and d.declined and d.trigger == "rps_below_envelope" and d.to_gear_id == "lat"
    assert "inside dwell (4.2 of 10.0 min), threshold raised to 4 samples" in d.reason
    assert d.required_samples == 4 and st.escalation_steps == 1
    assert d.estimated_gain_fraction > 0 and d.migration_cost_s == 30.0  # what it would have done
    # the same episode continuing does not raise it again
    st, ds = feed(ctrl, st, GEARS, [_bal(t, 1.0) for t in (260, 262, 264)])
    assert "threshold stays at 4 samples" in ds[-1].reason and st.escalation_steps == 1
    # the condition clears and comes back: a second episode raises it to 5 once it has held 4 samples
    st, _ = feed(ctrl, st, GEARS, [_bal(266, 5.0)])
    st, ds = feed(ctrl, st, GEARS, [_bal(t, 1.0) for t in (268, 270, 272, 274)])
    assert [d.declined for d in ds] == [False, False, False, True]
    assert "threshold raised to 5 samples" in ds[-1].reason and st.escalation_steps == 2


def test_after_dwell_the_raised_threshold_applies():
    ctrl = Controller(EXACT)
    st = _shift_to_bal(ctrl)
    st, ds = feed(ctrl, st, GEARS, [_bal(t, 1.0) for t in (100, 102, 104)])
    assert ds[-1].required_samples == 4
    # the load returns inside bal's envelope until after the dwell, then falls again: 4 samples needed
    st, _ = feed(ctrl, st, GEARS, [_bal(t, 5.0) for t in range(106, 620, 2)])
    st, ds = feed(ctrl, st, GEARS, [_bal(t, 1.0) for t in (620, 622, 624, 626)])
    assert [d.action for d in ds] == ["hold", "hold", "hold", "shift"]
    assert "4 samples)" in ds[-1].reason and ds[-1].required_samples == 4


def test_sustained_trigger_shifts_when_the_dwell_ends():
    ctrl = Controller(EXACT)
    st = _shift_to_bal(ctrl)
    st, ds = feed(ctrl, st, GEARS, [_bal(t, 1.0) for t in range(10, 620, 2)])
    shifts = [d for d in ds if d.action == "shift"]
    assert len(shifts) == 1 and shifts[0].t_s == 606  # first sample with 600 s since the shift at t=6
    at = ds.index(shifts[0])
    assert all(d.declined and "inside dwell" in d.reason for d in ds[2:at])
    assert all("in progress" in d.reason for d in ds[at + 1:])


def test_a_shift_up_the_overload_fires_waits_only_the_overload_dwell():
    """A shift to bal at t=6, then the load overruns bal (12 req/s > 10) 2 min later. With the seed
    dwell the shift up to thr is declined for 10 minutes; with ``overload_dwell_s`` 60 it goes as soon as
    the trigger has held 3 samples past 60 s. A shift down inside the dwell is still declined."""
    seed = Controller(EXACT)
    st = _shift_to_bal(seed)
    _, ds = feed(seed, st, GEARS, [_bal(t, 12.0) for t in (120, 122, 124)])
    assert ds[-1].declined and ds[-1].trigger == "rps_above_envelope" and "inside dwell (2.0 of 10.0 min)" in ds[-1].reason
    rising = Controller(EXACT.model_copy(update={"overload_dwell_s": 60.0}))
    st = _shift_to_bal(rising)
    st_up, ds = feed(rising, st, GEARS, [_bal(t, 12.0) for t in (50, 52, 54)])
    assert ds[-1].declined and "inside dwell (0.8 of 1.0 min)" in ds[-1].reason  # 48 s after the shift
    _, ds = feed(rising, st, GEARS, [_bal(t, 12.0) for t in (120, 122, 124)])
    assert ds[-1].action == "shift" and ds[-1].to_gear_id == "thr" and ds[-1].trigger == "rps_above_envelope"
    _, ds = feed(rising, st, GEARS, [_bal(t, 1.0) for t in (120, 122, 124)])  # the load falls instead
    assert ds[-1].declined and ds[-1].trigger == "rps_below_envelope" and "of 10.0 min" in ds[-1].reason


def test_escalation_decays_one_step_per_decay_period():
    ctrl = Controller(ControllerConfig(escalation_decay_s=100.0))
    st = ControllerState(gear_id="lat", gear_since_s=0.0, last_sample_t_s=0.0, escalation_steps=3,
                         last_escalation_s=0.0)
    st, d = ctrl.decide(st, [sample(250, "lat")], GEARS)
    assert st.escalation_steps == 1 and d.required_samples == 4 and st.last_escalation_s == 200.0


def test_unhealthy_serving_gear_is_left_at_once_even_inside_dwell():
    ctrl = Controller()
    st = _shift_to_bal(ctrl)
    st, d = ctrl.decide(st, [_bal(20, 8.0)], GEARS, unhealthy={"bal"})
    assert d.action == "shift" and d.trigger == "current_unhealthy" and d.to_gear_id == "thr"
    assert "unhealthy" in d.reason


# ----------------------------------------------------------------------------------------- payback
def test_payback_declines_a_shift_whose_migration_costs_more_than_it_gains():
    ctrl = Controller()
    samples = [sample(2 * i, "lat", rps=8.0) for i in range(1, 4)]
    _, ds = feed(ctrl, None, GEARS, samples, migration_cost_s=lambda a, b: 1e5)
    d = ds[-1]
    assert d.action == "hold" and d.declined and d.migration_cost_s == 1e5
    assert "does not pay back" in d.reason and d.estimated_gain_fraction * d.expected_residence_s < 1e5
    # the same trigger with a cheap migration shifts; the cost function sees the two gears
    seen = []
    _, ds = feed(ctrl, None, GEARS, samples, migration_cost_s=lambda a, b: seen.append((a.gear_id, b.gear_id)) or 5.0)
    assert ds[-1].action == "shift" and ds[-1].migration_cost_s == 5.0 and ("lat", "bal") in seen


def test_payback_prefers_a_cheaper_candidate_that_pays_back():
    ctrl = Controller()
    cost = {"bal": 1e5, "thr": 10.0}
    _, ds = feed(ctrl, None, GEARS, [sample(2 * i, "lat", rps=8.0) for i in range(1, 4)],
                 migration_cost_s=lambda a, b: cost[b.gear_id])
    assert ds[-1].action == "shift" and ds[-1].to_gear_id == "thr"


def test_no_shift_without_gain():
    # latency_under from "lat", but the only roomier gear does not fit the load: stay
    ctrl = Controller()
    gears = [LAT, THR]
    st, ds = feed(ctrl, None, gears, [sample(2 * i, "lat", rps=3.0, p99_ms=200.0) for i in range(1, 6)])
    assert all(d.action == "hold" for d in ds) and ds[-1].declined
    assert "no healthy gear whose envelope holds rps 3/s suits it" in ds[-1].reason


# ---------------------------------------------------------------------------------------- health
def test_unhealthy_gears_are_never_chosen():
    ctrl = Controller()
    samples = [sample(2 * i, "lat", rps=8.0) for i in range(1, 4)]
    _, ds = feed(ctrl, None, GEARS, samples, unhealthy={"bal"})
    assert ds[-1].action == "shift" and ds[-1].to_gear_id == "thr"
    _, ds = feed(ctrl, None, GEARS, samples, unhealthy={"thr", "bal"})
    assert ds[-1].action == "hold" and ds[-1].declined and "2 of 3 gears unhealthy" in ds[-1].reason


# ------------------------------------------------------------------------------------ state/cursor
def test_state_json_round_trip_is_exact_and_replays_identically():
    ctrl = Controller()
    rng = np.random.default_rng(7)
    rps = np.concatenate([rng.normal(3, 0.5, 40), rng.normal(9, 1.0, 60), rng.normal(1, 0.3, 400)])
    st_mem: ControllerState | None = None
    st_cur = ""
    gear = "lat"
    for i, q in enumerate(rps):
        s = sample(2.0 * (i + 1) + 0.1, gear, rps=float(q) + 0.1 + 0.2, p99_ms=float(rng.uniform(500, 1100)),
                   busy=tuple(float(x) for x in rng.uniform(0.3, 0.95, {"lat": 2, "bal": 3, "thr": 4}[gear])))
        st_mem, d_mem = ctrl.decide(st_mem, [s], GEARS)
        restored = ControllerState.from_cursor(st_cur)
        st_back, d_back = ctrl.decide(restored, [s], GEARS)
        assert d_back == d_mem and st_back == st_mem
        st_cur = st_back.to_cursor()
        again = ControllerState.from_cursor(st_cur)
        assert again == st_mem and again.to_cursor() == st_cur and again.model_dump() == st_mem.model_dump()
        if d_mem.action == "shift":
            gear = d_mem.to_gear_id
    assert st_mem.shifts >= 1  # the scenario exercised a shift, a pending phase and a new gear


def test_bad_cursor_and_bad_samples_raise_input_errors():
    with pytest.raises(InputError, match="sensor cursor"):
        ControllerState.from_cursor('{"ema_rps": "lots"}')
    with pytest.raises(InputError, match="version"):
        ControllerState.from_cursor('{"version": 99}')
    assert ControllerState.from_cursor(None) == ControllerState()
    with pytest.raises(InputError, match="'nope'"):
        Controller().decide(None, [sample(2, "nope")], GEARS)
    with pytest.raises(InputError, match="duplicate gear id"):
        Controller().decide(None, [sample(2, "lat")], [LAT, LAT])


def test_config_rejects_inconsistent_figures():
    with pytest.raises(ValueError, match="latency_under_factor"):
        ControllerConfig(latency_under_factor=1.5)
    with pytest.raises(ValueError, match="imbalance_min_util"):
        ControllerConfig(imbalance_min_util=0.95)


# ------------------------------------------------------------------------------------- no flapping
def _noisy_run(ctrl: Controller, rps_mean: float, hours: float, seed: int,
               p99_mean_ms: float = 900.0) -> tuple[int, list[Decision]]:
    """Stationary load with seeded noise whose raw samples often cross the thresholds."""
    rng = np.random.default_rng(seed)
    st, gear, decisions = None, "lat", []
    n = int(hours * 3600 / 2)
    for i in range(n):
        nstages = {"lat": 2, "bal": 3, "thr": 4}[gear]
        s = sample(2.0 * (i + 1), gear, rps=max(0.0, rng.normal(rps_mean, 0.25 * rps_mean)),
                   p99_ms=float(p99_mean_ms * np.exp(rng.normal(0.0, 0.25))),
                   busy=tuple(float(x) for x in np.clip(rng.normal(0.75, 0.12, nstages), 0, 1)))
        st, d = ctrl.decide(st, [s], GEARS)
        decisions.append(d)
        if d.action == "shift":
            gear = d.to_gear_id
    return st.shifts, decisions


def test_no_flapping_on_noisy_stationary_load():
    ctrl = Controller()
    # mean load 1.5/s inside lat's envelope [0, 5] (bal's starts at 2); mean P99 900 ms inside
    # [0.7, 1.2] x 1000 ms, but single samples fall outside it 29 % of the time
    shifts, decisions = _noisy_run(ctrl, rps_mean=1.5, hours=2.0, seed=1)
    counting = sum(1 for d in decisions if d.trigger is not None)
    assert counting > 0  # the noise does reach the thresholds ...
    assert shifts == 0  # ... but the smoothed, hysteretic controller stays put
    assert all(d.reason for d in decisions)


def test_load_on_an_envelope_boundary_never_flaps_faster_than_the_dwell():
    # mean load exactly at lat's rps_max (5/s), P99 noise independent of the gear: every move is
    # "justified" by some smoothed signal, yet no two shifts come within the 10 min dwell
    ctrl = Controller()
    for seed in (2, 3, 4):
        shifts, decisions = _noisy_run(ctrl, rps_mean=5.0, hours=2.0, seed=seed)
        times = [d.t_s for d in decisions if d.action == "shift"]
        assert shifts == len(times) <= 2 * 3  # <= 3 per hour
        assert all(b - a >= ctrl.config.dwell_s for a, b in zip(times, times[1:]))


# ----------------------------------------------------------------------------------------- gain
def test_gain_uses_observed_capacity_and_calibrates_estimates():
    from flexpipe_dag.control.payback import calibrated_p99_ms, estimated_gain_fraction

    cfg = ControllerConfig(target_p99_ms=TARGET_MS)
    kw = dict(rps=8.0, current_p99_ms=1600.0, target_p99_ms=TARGET_MS, config=cfg)
    # bal's estimate is 750 ms; it shows 1600 ms, so thr's 800 ms estimate is trusted as 1707 ms
    assert calibrated_p99_ms(THR, BAL, 1600.0, "ttft_p99_ms") == pytest.approx(800.0 * 1600.0 / 750.0)
    calibrated = estimated_gain_fraction("latency_over", BAL, THR, **kw)
    assert calibrated == pytest.approx((1000 / 1706.67 - 1000 / 1600.0) + 0.1 * (0 - 0), abs=1e-3)
    # backlogged: bal completes 2 req/s of 8; its P99 is the queue's, so thr's estimate stands
    backlog = estimated_gain_fraction("latency_over", BAL, THR, current_completed_rps=2.0, backlogged=True, **kw)
    assert backlog == pytest.approx(1.0 - (2.0 / 8.0) * (1000 / 1600.0) + 0.1 * (0.2 - 0.0))


def test_a_gear_identical_to_the_serving_one_is_never_a_target():
    twin = THR.model_copy(update={"gear_id": "thr-twin", "kind": "balanced"})
    ctrl = Controller()
    # thr is overloaded at 30/s; its twin (same stages and batching) cannot help, bal/lat cannot hold it
    _, ds = feed(ctrl, None, [LAT, THR, twin], [sample(2 * i, "thr", rps=30.0, busy=(0.9,) * 4) for i in range(1, 5)])
    assert all(d.action == "hold" for d in ds) and ds[-1].to_gear_id != "thr-twin"


def test_latency_over_on_a_backlogged_gear_never_moves_to_less_capacity():
    # thr (capacity 20/s) is backlogged: 40 requests wait, 3 run; its P99 is the queue's. The load,
    # 4.5/s, fits lat's and bal's envelopes, but both hold less than thr: moving there would drain
    # the backlog slower, so the shift is declined. Without a backlog the same figures move to lat.
    import dataclasses

    ctrl = Controller()
    backlogged = [dataclasses.replace(sample(2 * i, "thr", rps=4.5, p99_ms=5000.0, busy=(0.9,) * 4),
                                      queue_length=40, completed=6) for i in range(1, 4)]
    st, ds = feed(ctrl, None, GEARS, backlogged)
    assert ctrl.backlogged(st) and all(d.action == "hold" for d in ds) and st.shifts == 0
    assert ds[-1].trigger == "latency_over" and ds[-1].declined and "no healthy gear" in ds[-1].reason
    _, ds = feed(ctrl, None, GEARS, [sample(2 * i, "thr", rps=4.5, p99_ms=5000.0) for i in range(1, 4)])
    assert ds[-1].action == "shift" and ds[-1].to_gear_id == "lat"
