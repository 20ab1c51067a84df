"""Offline admission against the tide: forecast, hysteresis, online priority."""

import numpy as np
import pytest

from flexpipe_dag.control.tide import TideConfig, TideForecaster, decide_offline, ema
from flexpipe_dag.workload.bundled import load_tide_trace
from flexpipe_dag.workload.tide import Tide


def _square_tide() -> Tide:
    # two days: low (10 req/s) from 00:00 to 12:00, high (40 req/s) from 12:00 to 24:00
    day = np.r_[np.full(72, 10.0), np.full(72, 40.0)]
    return Tide(window_s=600.0, rates_rps=np.r_[day, day], source="square")


def test_forecast_scales_profile_to_live_level_and_looks_ahead():
    f = TideForecaster(_square_tide())
    assert f.profile_at(3600) == 10.0 and f.profile_at(13 * 3600) == 40.0
    assert f.forecast_rps(3600, rps_now=2.0, horizon_s=1800) == pytest.approx(2.0)
    # at 11:45 the rise at 12:00 is inside a 30 min horizon: 4x the live level
    assert f.forecast_rps(11.75 * 3600, rps_now=2.0, horizon_s=1800) == pytest.approx(8.0)


def test_admit_in_trough_pause_on_rise_keep_between():
    f, cfg = TideForecaster(_square_tide()), TideConfig(horizon_s=1800)
    admit = decide_offline(f, cfg, tide_time_s=3600, ema_rps=2.0, capacity_rps=10.0, offline_running=False)
    assert admit.action == "admit" and "trough" in admit.reason
    # the rise is forecast within the horizon: running offline work is paused before it arrives
    pause = decide_offline(f, cfg, tide_time_s=11.75 * 3600, ema_rps=2.0, capacity_rps=10.0, offline_running=True)
    assert pause.action == "pause"
    # between the thresholds nothing changes either way (hysteresis)
    for running in (True, False):
        keep = decide_offline(f, cfg, tide_time_s=3600, ema_rps=6.0, capacity_rps=10.0, offline_running=running)
        assert keep.action == "keep"


def test_online_load_above_pause_threshold_always_pauses():
    f = TideForecaster(_square_tide())
    d = decide_offline(f, TideConfig(), tide_time_s=3600, ema_rps=9.0, capacity_rps=10.0, offline_running=True)
    assert d.action == "pause"


def test_thresholds_must_leave_a_hysteresis_band():
    with pytest.raises(ValueError):
        TideConfig(admit_below_fraction=0.8, pause_above_fraction=0.7)


def test_real_servegen_tide_has_troughs_and_peaks():
    f = TideForecaster(load_tide_trace())
    levels = [f.profile_at(h * 3600) for h in range(24)]
    assert max(levels) > 2 * min(levels)  # the real daily tide: peak well above trough
    assert ema(None, 5.0, 0.3) == 5.0 and ema(5.0, 10.0, 0.3) == pytest.approx(6.5)


def test_gate_needs_consecutive_decisions_and_round_trips():
    from flexpipe_dag.control.tide import TideDecision, TideGate

    admit = TideDecision("admit", 1.0, 1.0, 10.0, "trough")
    keep = TideDecision("keep", 6.0, 6.0, 10.0, "between")
    gate = TideGate()
    gate, act = gate.step(admit, 3)
    gate, act = gate.step(admit, 3)
    assert act is None and not gate.running
    gate, act = gate.step(keep, 3)  # the run of admits is broken: start again
    assert gate.count == 0
    for _ in range(2):
        gate, act = gate.step(admit, 3)
    gate, act = gate.step(admit, 3)
    assert act is admit and gate.running
    assert TideGate.model_validate_json(gate.model_dump_json()) == gate
