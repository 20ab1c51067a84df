"""Controller: ``downshift_headroom_fraction`` hands devices back once a gear on fewer devices holds the load,
its recent peak and the forecast with headroom (trigger ``fewer_devices_hold``); off by default."""

from __future__ import annotations

import pytest

from flexpipe_dag.control import Controller, ControllerConfig
from tests.test_control_controller import GEARS, feed, make_gear, sample
from tests.test_control_forecast import constant

# LAT holds 5 req/s on 2 devices, BAL 10 on 3, THR 20 on 4 (tests.test_control_controller)
HEADROOM = dict(downshift_headroom_fraction=0.2, device_weight=0.2, forecast_horizon_s=600.0)


def _samples(gear_id: str, rps: float, n: int, start: int = 1, stages: int = 3):
    return [sample(2 * i, gear_id, rps=rps, busy=(0.7,) * stages) for i in range(start, start + n)]


def test_off_by_default_the_gear_holding_the_load_stays():
    _, ds = feed(Controller(ControllerConfig(device_weight=0.2)), None, GEARS, _samples("bal", 3.0, 6))
    assert all(d.action == "hold" and d.trigger is None for d in ds)  # 3 req/s is inside BAL's [2, 10]


def test_a_gear_on_fewer_devices_that_holds_the_load_with_headroom_takes_over():
    ctrl = Controller(ControllerConfig(**HEADROOM))
    _, ds = feed(ctrl, None, GEARS, _samples("bal", 3.0, 3), forecast=constant(3.5))
    assert [d.action for d in ds] == ["hold", "hold", "shift"]
    shift = ds[-1]
    assert shift.trigger == "fewer_devices_hold" and shift.to_gear_id == "lat"
    assert "a gear on fewer than 3 devices holds rps 3/s, its recent peak and forecast (3.5/s) with 20% headroom" \
        in shift.reason
    assert shift.estimated_gain_fraction > 0  # the device term pays for it: 0.2 x (3 - 2) / 3


@pytest.mark.parametrize("rps, forecast", [(4.5, 4.5),   # 4.5 > 5 x 0.8: no headroom left on LAT
                                           (3.0, 4.2)])  # the forecast expects more than LAT holds with headroom
def test_no_shift_down_without_the_headroom_for_the_load_and_the_forecast(rps, forecast):
    ctrl = Controller(ControllerConfig(**HEADROOM))
    _, ds = feed(ctrl, None, GEARS, _samples("bal", rps, 6), forecast=constant(forecast))
    assert all(d.action == "hold" for d in ds) and all(d.trigger != "fewer_devices_hold" for d in ds)


def test_load_below_the_envelope_goes_to_the_fewest_devices_not_the_nearest_kind():
    # 1 req/s on THR (envelope from 4): the gearbox picks BAL (nearest kind down); with the headroom figure on,
    # LAT (2 devices) holds 1 req/s with 20 % headroom and takes it
    gears = [make_gear("lat", "latency", rps_max=5.0, est_p99_ms=700.0),
             make_gear("bal", "balanced", rps_min=0.0, rps_max=10.0, est_p99_ms=750.0, devices=("d0", "d1", "d2")),
             make_gear("thr", "throughput", rps_min=4.0, rps_max=20.0, est_p99_ms=800.0,
                       devices=("d0", "d1", "d2", "d3"))]
    seeds = Controller(ControllerConfig(device_weight=0.2, forecast_horizon_s=600.0))
    _, ds = feed(seeds, None, gears, _samples("thr", 1.0, 3, stages=4), forecast=constant(1.0))
    assert ds[-1].action == "shift" and ds[-1].to_gear_id == "bal" and ds[-1].trigger == "rps_below_envelope"
    ctrl = Controller(ControllerConfig(**HEADROOM))
    _, ds = feed(ctrl, None, gears, _samples("thr", 1.0, 3, stages=4), forecast=constant(1.0))
    assert ds[-1].action == "shift" and ds[-1].to_gear_id == "lat" and ds[-1].trigger == "rps_below_envelope"


def test_fewer_devices_hold_respects_the_dwell_and_never_raises_its_threshold():
    ctrl = Controller(ControllerConfig(**HEADROOM, dwell_s=600.0))
    # 4.5 req/s on THR (inside its [4, 20]): BAL holds it with 20 % headroom, LAT (4 with headroom) does not
    st, ds = feed(ctrl, None, GEARS, _samples("thr", 4.5, 3, stages=4), forecast=constant(4.5))
    assert ds[-1].action == "shift" and ds[-1].to_gear_id == "bal" and ds[-1].trigger == "fewer_devices_hold"
    # on BAL, inside the dwell, the load falls to where LAT holds it: declined for the dwell, threshold unraised
    st, ds = feed(ctrl, st, GEARS, _samples("bal", 3.0, 20, start=4), forecast=constant(3.0))
    assert all(d.action == "hold" for d in ds)
    assert any(d.reason_kind == "dwell" and d.trigger == "fewer_devices_hold" for d in ds)
    assert st.escalation_steps == 0 and ctrl.required_samples(st) == 3


def test_the_recent_peak_holds_the_shift_down_back():
    ctrl = Controller(ControllerConfig(**HEADROOM, recent_peak_window_s=600.0))
    st, _ = feed(ctrl, None, GEARS, _samples("bal", 6.0, 3), forecast=constant(0.0))
    _, ds = feed(ctrl, st, GEARS, _samples("bal", 1.0, 10, start=4), forecast=constant(0.0))
    # the smoothed rate fell to ~1-2 req/s, but the peak of the last 10 min (6) is over LAT's 4 with headroom
    assert all(d.action == "hold" for d in ds) and ctrl.headroom_load_rps(st) >= 4.0


def test_upshift_headroom_leaves_a_gear_before_its_envelope_top():
    samples = _samples("lat", 4.7, 3, stages=2)  # LAT holds 5 req/s: 4.7 is inside, above 90 % of it
    _, ds = feed(Controller(ControllerConfig()), None, GEARS, samples)
    assert all(d.action == "hold" for d in ds)
    _, ds = feed(Controller(ControllerConfig(upshift_headroom_fraction=0.1)), None, GEARS, samples)
    assert ds[-1].action == "shift" and ds[-1].to_gear_id == "bal" and ds[-1].trigger == "rps_above_envelope"
    assert "rps 4.7/s above 90% of envelope max 5" in ds[-1].reason


def test_upshift_headroom_must_stay_below_the_downshift_headroom():
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="must exceed upshift_headroom_fraction"):
        ControllerConfig(downshift_headroom_fraction=0.1, upshift_headroom_fraction=0.1)
    ControllerConfig(downshift_headroom_fraction=0.25, upshift_headroom_fraction=0.1)
