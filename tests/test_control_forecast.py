"""Controller beyond the seeds: the load forecast trigger, the device cost, request rate smoothing, envelope-capped estimates."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flexpipe_dag.control import Controller, ControllerConfig
from flexpipe_dag.control.payback import calibrated_p99_ms, estimated_gain_fraction
from flexpipe_dag.control.tide import TideForecaster, tide_forecast
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.workload.tide import Tide
from tests.test_control_controller import BAL, GEARS, LAT, TARGET_MS, THR, feed, make_gear, sample


def constant(value: float):
    """A forecast that expects ``value`` req/s whatever the time; records what it was asked."""
    calls = []

    def forecast(t_s, rps, horizon_s):
        calls.append((t_s, rps, horizon_s))
        return value

    forecast.calls = calls
    return forecast


# ------------------------------------------------------------------------------------------ forecast
def test_forecast_above_envelope_shifts_before_the_load_arrives():
    ctrl = Controller(ControllerConfig(forecast_horizon_s=600.0))
    fc = constant(8.0)  # LAT holds 5 req/s; 8 are coming, the load now is 3
    st, ds = feed(ctrl, None, GEARS, [sample(2 * i, "lat", rps=3.0) for i in range(1, 4)], forecast=fc)
    assert [d.action for d in ds] == ["hold", "hold", "shift"]
    shift = ds[-1]
    assert shift.trigger == "forecast_above_envelope" and shift.to_gear_id == "bal"  # nearest gear up holding 8
    assert "forecast rps 8/s within 10.0 min above envelope max 5 (now 3/s)" in shift.reason
    assert st.forecast_rps == 8.0 and fc.calls[-1] == pytest.approx((6.0, 3.0, 600.0))  # asked with the smoothed request rate


def test_forecast_is_ignored_without_a_horizon_or_below_the_envelope():
    seeds = Controller()  # forecast_horizon_s 0: the seeds react to what they see
    st, ds = feed(seeds, None, GEARS, [sample(2 * i, "lat", rps=3.0) for i in range(1, 6)], forecast=constant(8.0))
    assert all(d.action == "hold" for d in ds) and st.forecast_rps is None
    ctrl = Controller(ControllerConfig(forecast_horizon_s=600.0))
    _, ds = feed(ctrl, None, GEARS, [sample(2 * i, "lat", rps=3.0) for i in range(1, 6)], forecast=constant(4.0))
    assert all(d.action == "hold" for d in ds)


def test_forecast_beyond_every_envelope_moves_to_the_roomiest_gear():
    ctrl = Controller(ControllerConfig(forecast_horizon_s=600.0))
    _, ds = feed(ctrl, None, GEARS, [sample(2 * i, "bal", rps=6.0, busy=(0.7,) * 3) for i in range(1, 4)],
                 forecast=constant(50.0))
    assert ds[-1].action == "shift" and ds[-1].to_gear_id == "thr"


def test_rising_forecast_keeps_the_load_from_counting_as_below_the_envelope():
    # THR's envelope starts at 4 req/s; the load is 2 but the forecast says 10 are coming: stay
    ctrl = Controller(ControllerConfig(forecast_horizon_s=600.0))
    busy = (0.5,) * 4
    st, ds = feed(ctrl, None, GEARS, [sample(2 * i, "thr", rps=2.0, busy=busy) for i in range(1, 6)],
                  forecast=constant(10.0))
    assert all(d.action == "hold" for d in ds) and "rps_below_envelope" not in st.counts
    _, ds = feed(Controller(), None, GEARS, [sample(2 * i, "thr", rps=2.0, busy=busy) for i in range(1, 4)])
    assert ds[-1].trigger == "rps_below_envelope" and ds[-1].action == "shift"  # without the forecast it leaves


def _raises(t, q, h):
    raise RuntimeError("tide store offline")


@pytest.mark.parametrize("bad, said", [(lambda t, q, h: -1.0, "returned -1.0"), (lambda t, q, h: math.nan, "returned nan"),
                                       (lambda t, q, h: None, "raised TypeError"),
                                       (lambda t, q, h: 10 ** 400, "raised OverflowError"),
                                       (_raises, "raised RuntimeError: tide store offline")])
def test_a_failing_forecast_is_ignored_and_said(bad, said):
    ctrl = Controller(ControllerConfig(forecast_horizon_s=600.0))
    st, d = ctrl.decide(None, [sample(2, "lat")], GEARS, forecast=bad)
    assert st.forecast_rps is None and said in st.forecast_error
    assert d.action == "hold" and f"[forecast ignored: the forecast {said}" in d.reason and "at t_s=2" in d.reason


def test_a_failing_forecast_never_holds_back_leaving_an_unhealthy_gear():
    ctrl = Controller(ControllerConfig(forecast_horizon_s=600.0))
    _, d = ctrl.decide(None, [sample(2, "lat")], GEARS, unhealthy={"lat"}, forecast=_raises)
    assert d.action == "shift" and d.trigger == "current_unhealthy" and "forecast ignored" in d.reason


@pytest.mark.parametrize("figures, field", [
    (dict(forecast_horizon_s=1e300), "forecast_horizon_s"), (dict(forecast_horizon_s=86401.0), "forecast_horizon_s"),
    (dict(recent_peak_window_s=1e-320), "recent_peak_window_s"), (dict(device_weight=True), "device_weight"),
    (dict(rps_ema_alpha=math.nan), "rps_ema_alpha"), (dict(envelope_margin_fraction=math.nan), "envelope_margin_fraction"),
])
def test_extreme_figures_are_refused(figures, field):
    with pytest.raises(ValueError, match=field):
        ControllerConfig(**figures)


def test_tide_figures_refuse_infinity_booleans_and_more_than_a_day():
    from flexpipe_dag.control.tide import TideConfig

    for figures in (dict(horizon_s=math.inf), dict(horizon_s=90000.0), dict(time_compression=math.inf),
                    dict(ema_alpha=True), dict(admit_below_fraction=math.nan)):
        with pytest.raises(ValueError, match=next(iter(figures))):
            TideConfig(**figures)


def test_tide_history_file_feeds_the_forecasts(tmp_path):
    from flexpipe_dag.control.tide import TideConfig, load_history

    path = tmp_path / "our_tide.csv"
    rows = "\n".join(f"{600 * k},{1.0 if k % 144 < 72 else 5.0}" for k in range(288))
    path.write_text("window_start_s,total_rate_req_per_s\n" + rows + "\n")
    tide = load_history(TideConfig(history_file=str(path)))
    assert tide.daily_profile()[0] == 1.0 and tide.daily_profile()[100] == 5.0
    assert load_history(TideConfig()).source.endswith("servegen_tide_14d.csv")
    with pytest.raises(ValueError, match="missing.csv"):  # refused when the settings load
        TideConfig(history_file=str(tmp_path / "missing.csv"))
    gone = tmp_path / "gone.csv"
    gone.write_text(path.read_text())
    config = TideConfig(history_file=str(gone))
    gone.unlink()  # removed after the settings loaded: named when the forecast reads it
    with pytest.raises(InputError, match="gone.csv"):
        load_history(config)


def test_old_cursors_read_and_newer_ones_are_named():
    from flexpipe_dag.control import ControllerState

    old = ControllerState(gear_id="lat", ema_rps=2.5).model_dump(mode="json")
    for key in ("forecast_rps", "forecast_error", "rps_peaks", "last_discretionary_shift"):
        old.pop(key)
    # a version-1 cursor spelled the request rate qps
    old = {("ema_qps" if k == "ema_rps" else k): v for k, v in old.items()}
    old.update(version=1, counts={"qps_below_envelope": 2}, escalated=["qps_above_envelope"])
    import json

    st = ControllerState.from_cursor(json.dumps(old))
    assert st.version == 3 and st.ema_rps == 2.5 and st.rps_peaks == []
    assert st.counts == {"rps_below_envelope": 2} and st.escalated == ["rps_above_envelope"]
    with pytest.raises(InputError, match="version 4.*reads versions"):
        ControllerState.from_cursor(json.dumps(old | {"version": 4, "from_the_future": 1}))


def test_tide_forecast_maps_the_samples_clock_to_tide_time():
    # a two-day tide of 600-s windows: the rate is 1 until 06:00, then 4
    day = np.where(np.arange(144) < 36, 1.0, 4.0)
    tide = Tide(window_s=600.0, rates_rps=np.concatenate([day, day]), source="two days")
    forecaster = TideForecaster(tide.without_days([1]))
    # 12x compression, replay starting at 04:00 (tide 14400 s): sample t = 300 s is 05:00
    fc = tide_forecast(forecaster, lambda t_s: 14400.0 + 12.0 * t_s, 12.0)
    assert fc(300.0, 2.0, 0.0) == pytest.approx(2.0)  # no rise inside a zero horizon
    assert fc(300.0, 2.0, 300.0) == pytest.approx(8.0)  # 300 s ahead = 1 h of tide: 06:00 is inside, x4
    assert fc(300.0, 2.0, 240.0) == pytest.approx(2.0)  # 48 min of tide: 05:48 is not yet 06:00


def test_tide_without_days_drops_whole_days_and_names_bad_ones():
    rates = np.concatenate([np.full(144, 1.0), np.full(144, 3.0), np.full(144, 5.0)])
    tide = Tide(window_s=600.0, rates_rps=rates, source="t.csv")
    assert tide.without_days([1]).daily_profile() == pytest.approx(np.full(144, 3.0))  # mean of 1 and 5
    with pytest.raises(InputError, match=r"t.csv.*day.*\[3\] are outside the history's 3 whole days"):
        tide.without_days([3])
    with pytest.raises(InputError, match="leaves no whole day"):
        tide.without_days([0, 1, 2])


# ------------------------------------------------------------------------------------------ devices
def test_device_weight_keeps_a_cheap_gear_that_holds_the_load():
    # latency well under target on LAT (2 devices): the seeds move to a roomier gear, a device cost keeps LAT
    kw = dict(rps=3.0, p99_ms=300.0)
    _, ds = feed(Controller(ControllerConfig(dwell_s=0.0)), None, GEARS, [sample(2 * i, "lat", **kw) for i in range(1, 4)])
    assert ds[-1].action == "shift" and ds[-1].trigger == "latency_under"
    ctrl = Controller(ControllerConfig(device_weight=0.5))
    _, ds = feed(ctrl, None, GEARS, [sample(2 * i, "lat", **kw) for i in range(1, 4)])
    assert ds[-1].action == "hold" and ds[-1].declined and "does not pay back" in ds[-1].reason


def test_device_weight_never_holds_back_a_gear_that_lost_the_load():
    ctrl = Controller(ControllerConfig(device_weight=1.0))
    _, ds = feed(ctrl, None, GEARS, [sample(2 * i, "lat", rps=8.0) for i in range(1, 4)])
    assert ds[-1].action == "shift" and ds[-1].trigger == "rps_above_envelope" and ds[-1].to_gear_id == "bal"


def test_device_term_of_the_gain():
    cfg0, cfg = ControllerConfig(target_p99_ms=TARGET_MS), ControllerConfig(target_p99_ms=TARGET_MS, device_weight=0.3)
    kw = dict(rps=3.0, current_p99_ms=300.0, target_p99_ms=TARGET_MS)
    # LAT (2 devices) -> THR (4): charged 0.3 x 2 / 4 on a discretionary trigger, free on a rising one
    for trigger, charge in (("latency_under", 0.15), ("imbalance", 0.15), ("rps_above_envelope", 0.0)):
        base = estimated_gain_fraction(trigger, LAT, THR, config=cfg0, **kw)
        assert estimated_gain_fraction(trigger, LAT, THR, config=cfg, **kw) == pytest.approx(base - charge)
    # THR -> LAT hands two of four devices back
    base = estimated_gain_fraction("rps_below_envelope", THR, LAT, config=cfg0, **kw)
    assert estimated_gain_fraction("rps_below_envelope", THR, LAT, config=cfg, **kw) == pytest.approx(base + 0.15)


# ------------------------------------------------------------------------------------------ smoothing
def test_rps_ema_alpha_smooths_the_rate_alone():
    ctrl = Controller(ControllerConfig(rps_ema_alpha=0.1))
    st, _ = ctrl.decide(None, [sample(2, "lat", rps=10, p99_ms=400), sample(4, "lat", rps=0, p99_ms=800)], GEARS)
    assert st.ema_rps == pytest.approx(9.0) and st.ema_p99_ms == pytest.approx(0.3 * 800 + 0.7 * 400)
    with pytest.raises(ValueError, match="rps_ema_alpha"):
        ControllerConfig(rps_ema_alpha=0.0)


# ------------------------------------------------------------------------------------------ estimates
def test_envelope_caps_a_candidate_estimate_at_the_target():
    slow = make_gear("slow", "throughput", rps_min=0.0, rps_max=20.0, est_p99_ms=1500.0)  # estimate at rps_max
    assert calibrated_p99_ms(slow, LAT, None, "ttft_p99_ms") == 1500.0
    assert calibrated_p99_ms(slow, LAT, None, "ttft_p99_ms", within_target_ms=TARGET_MS) == TARGET_MS
    # the serving gear's model error still scales it: LAT shows 1400 ms against its 700 ms estimate
    assert calibrated_p99_ms(slow, LAT, 1400.0, "ttft_p99_ms", within_target_ms=TARGET_MS) == 2 * TARGET_MS
    # the gain of holding a load the serving gear cannot: full SLO credit inside the candidate's envelope
    cfg = ControllerConfig(target_p99_ms=TARGET_MS)
    gain = estimated_gain_fraction("rps_above_envelope", BAL, slow, rps=15.0, current_p99_ms=700.0,
                                   target_p99_ms=TARGET_MS, config=cfg)
    assert gain == pytest.approx((1.0 - 10.0 / 15.0) + cfg.envelope_fit_weight)


# ------------------------------------------------------------------------------------------ recent peak
def test_a_dip_does_not_shift_down_to_a_gear_the_recent_peak_overruns():
    # THR served 12 req/s seconds ago; the load dips to 3: BAL (10 req/s) and LAT (5) would be overrun by a burst
    cfg = dict(dwell_s=0.0, ema_alpha=1.0)
    busy = (0.5,) * 4
    burst = [sample(2 * i, "thr", rps=12.0, busy=busy) for i in range(1, 4)]
    dip = [sample(6 + 2 * i, "thr", rps=3.0, busy=busy) for i in range(1, 4)]
    _, ds = feed(Controller(ControllerConfig(**cfg)), None, GEARS, burst + dip)
    assert ds[-1].action == "shift" and ds[-1].trigger == "rps_below_envelope" and ds[-1].to_gear_id == "bal"
    ctrl = Controller(ControllerConfig(recent_peak_window_s=600.0, **cfg))
    st, ds = feed(ctrl, None, GEARS, burst + dip)
    assert ds[-1].action == "hold" and ds[-1].declined
    assert "for a smaller gear, the recent peak or forecast 12/s" in ds[-1].reason and ctrl.recent_peak_rps(st) == 12.0
    # ten minutes of the low load later the burst has left the window: the shift down goes ahead
    st, ds = feed(ctrl, st, GEARS, [sample(12 + 30 * i, "thr", rps=3.0, busy=busy) for i in range(1, 25)])
    assert any(d.action == "shift" and d.to_gear_id == "bal" for d in ds)
    assert ctrl.recent_peak_rps(st) == 3.0 and len(st.rps_peaks) <= 11


def test_recent_peaks_round_trip_through_the_cursor():
    from flexpipe_dag.control import ControllerState

    ctrl = Controller(ControllerConfig(recent_peak_window_s=600.0))
    st, _ = feed(ctrl, None, GEARS, [sample(2 * i, "lat", rps=float(i)) for i in range(1, 40)])
    assert ControllerState.from_cursor(st.to_cursor()) == st and st.rps_peaks


def test_no_discretionary_shift_down_into_a_gear_the_forecast_overruns():
    # BAL is imbalanced at 3 req/s; LAT holds 3 but not the 7 the forecast expects: stay
    busy = (0.95, 0.4, 0.7)
    kw = dict(rps=3.0, busy=busy)
    _, ds = feed(Controller(), None, GEARS, [sample(2 * i, "bal", **kw) for i in range(1, 4)])
    assert ds[-1].action == "shift" and ds[-1].trigger == "imbalance" and ds[-1].to_gear_id == "lat"
    ctrl = Controller(ControllerConfig(forecast_horizon_s=600.0))
    _, ds = feed(ctrl, None, GEARS, [sample(2 * i, "bal", **kw) for i in range(1, 4)], forecast=constant(7.0))
    assert ds[-1].action == "hold" and ds[-1].declined and "recent peak or forecast 7/s" in ds[-1].reason


def test_discretionary_triggers_do_not_ping_pong_within_the_reversal_window():
    # latency under target moves LAT -> BAL; BAL then looks imbalanced, which would move it straight back
    up = [sample(2 * i, "lat", rps=3.0, p99_ms=300.0) for i in range(1, 4)]
    back = [sample(10 + 2 * i, "bal", rps=3.0, p99_ms=300.0, busy=(0.95, 0.4, 0.7)) for i in range(1, 4)]
    _, ds = feed(Controller(ControllerConfig(dwell_s=0.0)), None, [LAT, BAL], up + back)
    assert ds[2].trigger == "latency_under" and ds[2].to_gear_id == "bal"
    assert ds[-1].action == "shift" and ds[-1].trigger == "imbalance" and ds[-1].to_gear_id == "lat"
    ctrl = Controller(ControllerConfig(dwell_s=0.0, reversal_window_s=1800.0))
    st, ds = feed(ctrl, None, [LAT, BAL], up + back)
    assert st.last_discretionary_shift == ("lat", "bal", 6.0)
    assert ds[-1].action == "hold" and ds[-1].declined and ds[-1].trigger == "imbalance"
    assert "back to lat would undo the shift at t=6 s inside reversal_window_s 1800 s" in ds[-1].reason
    # past the window the reversal is allowed
    st, ds = feed(ctrl, st, [LAT, BAL], [sample(1900 + 2 * i, "bal", rps=3.0, p99_ms=300.0, busy=(0.95, 0.4, 0.7))
                                        for i in range(1, 4)])
    assert ds[0].action == "shift" and ds[0].to_gear_id == "lat" and ds[0].trigger == "imbalance"


def test_reversal_window_never_holds_back_a_forced_shift():
    ctrl = Controller(ControllerConfig(dwell_s=0.0, ema_alpha=1.0, reversal_window_s=1800.0))
    down = [sample(2 * i, "bal", rps=0.5, busy=(0.3,) * 3) for i in range(1, 4)]  # below BAL's 2 req/s
    st, ds = feed(ctrl, None, [LAT, BAL], down)
    assert ds[-1].to_gear_id == "lat" and st.last_discretionary_shift == ("bal", "lat", 6.0)
    st, ds = feed(ctrl, st, [LAT, BAL], [sample(10 + 2 * i, "lat", rps=8.0) for i in range(1, 4)])
    assert ds[-1].action == "shift" and ds[-1].trigger == "rps_above_envelope" and ds[-1].to_gear_id == "bal"
