"""gear_shift_sensor and tide_sensor with build_sensor_context; the gear_shift run's store protocol."""

from __future__ import annotations

import json
import re

import pytest
from dagster import DagsterInstance, RunRequest, SkipReason, build_sensor_context

from flexpipe_dag.control.cursor import make_fleet_shift_cursor, parse_cursor, read_fleet_shift_cursor
from flexpipe_dag.control.settings import resolve_control_settings
from flexpipe_dag.control.tide import TideConfig
from flexpipe_dag.core.metrics import MetricSample, StageSample
from flexpipe_dag.jobs.gear_shift import gear_shift, gear_shift_sensor
from flexpipe_dag.jobs.tide import tide_sensor
from flexpipe_dag.resources.control import ControlSettings
from flexpipe_dag.resources.store_resource import StoreResource
from tests.support import EXAMPLES, BackgroundThread, enveloped_gear, wait_until


@pytest.fixture
def store_res(tmp_path):
    from flexpipe_dag.core.cluster import load_cluster_profile

    res = StoreResource(database_url=f"sqlite:///{tmp_path / 'fp.db'}")
    db = res.get_store()
    info = db.save_profile(load_cluster_profile(EXAMPLES / "seed_example.yaml"))
    model_id = db.save_model("SmolLM2-135M", "bf16", 30, {"layers": 30})
    db.save_gears([enveloped_gear("latency-1s", "latency", 0.0, 5.0, 1), enveloped_gear("throughput-2s", "throughput", 3.5, 40.0, 2)],
                  info.id, model_id)
    return res


def _samples(gear_id, rps_values, t0=0.0):
    return [MetricSample(t_s=t0 + 2.0 * (i + 1), gear_id=gear_id, source="live", rps=q, completed=int(q * 2),
                         tokens_per_s=q * 100, queue_length=5, running=8, kv_used_fraction=0.3,
                         ttft_p99_ms=300.0, tpot_p99_ms=40.0,
                         stages=(StageSample(0, 0.8, 1, 10, 100),)) for i, q in enumerate(rps_values)]


def _tick(sensor, store_res, cursor=None, **control):
    ctx = build_sensor_context(instance=DagsterInstance.ephemeral(), cursor=cursor,
                               resources={"store": store_res, "control": ControlSettings(**control)})
    result = sensor(ctx)
    return result, ctx.cursor


def test_gear_shift_sensor_launches_one_run_with_deterministic_key(store_res):
    db = store_res.get_store()
    db.write_samples("live", _samples("latency-1s", [2.0, 2.0]))
    result, cursor = _tick(gear_shift_sensor, store_res)
    assert isinstance(result, SkipReason)  # load inside the envelope: hold
    db.write_samples("live", _samples("latency-1s", [12.0] * 6, t0=4.0))  # load far above latency-1s's 5 req/s
    result, cursor2 = _tick(gear_shift_sensor, store_res, cursor)
    assert isinstance(result, RunRequest), result
    assert result.run_key.startswith("gear-shift:latency-1s->throughput-2s@t")
    cfg = result.run_config["ops"]["apply_gear_shift"]["config"]
    assert cfg["to_gear_id"] == "throughput-2s" and cfg["trigger"] == "rps_above_envelope"
    assert "rps" in cfg["reason"]
    # the same tick evaluated again (a retried tick) asks for the same run key: Dagster launches one run
    again, _ = _tick(gear_shift_sensor, store_res, cursor)
    assert isinstance(again, RunRequest) and again.run_key == result.run_key
    # the next tick with the stored cursor has nothing new: no duplicate across ticks
    nothing, cursor3 = _tick(gear_shift_sensor, store_res, cursor2)
    assert isinstance(nothing, SkipReason)
    events = [e for e in db.shift_events() if e.action == "shift"]
    assert events and events[-1].reason == cfg["reason"] and events[-1].to_gear_key == "throughput-2s"


def test_cursor_round_trips_exactly(store_res):
    db = store_res.get_store()
    db.write_samples("live", _samples("latency-1s", [2.0, 3.0, 2.5]))
    _, cursor = _tick(gear_shift_sensor, store_res)
    runs = read_fleet_shift_cursor(cursor)  # one cursor per serving run followed
    assert list(runs) == ["live"] and make_fleet_shift_cursor(runs) == cursor
    state, last_id, run_key = parse_cursor(runs["live"])
    assert run_key == "live"
    assert last_id is not None and state is not None
    assert json.loads(runs["live"])["controller"] == state.to_cursor()
    # another run's samples (a run never registered, so followed on its own) never reach this run's controller
    db.write_samples("other-run", _samples("throughput-2s", [9.0] * 3, t0=100.0))
    db.write_samples("live", _samples("latency-1s", [2.0], t0=200.0))
    _, cursor2 = _tick(gear_shift_sensor, store_res, cursor)
    runs2 = read_fleet_shift_cursor(cursor2)
    assert sorted(runs2) == ["live", "other-run"]
    assert parse_cursor(runs2["live"])[0].gear_id == "latency-1s"
    assert parse_cursor(runs2["other-run"])[0].gear_id == "throughput-2s"
    assert type(state).from_cursor(state.to_cursor()) == state


def test_decision_inside_dwell_is_declined_with_reason(store_res):
    db = store_res.get_store()
    db.write_samples("live", _samples("latency-1s", [12.0] * 6))
    result, cursor = _tick(gear_shift_sensor, store_res)
    assert isinstance(result, RunRequest)
    # the pipeline now serves throughput-2s; load falls below its envelope within the 10 min dwell
    db.write_samples("live", _samples("throughput-2s", [0.5] * 8, t0=20.0))
    result, cursor = _tick(gear_shift_sensor, store_res, cursor)
    assert isinstance(result, SkipReason)
    declined = [e for e in db.shift_events() if e.status == "declined"]
    assert declined, [e.reason for e in db.shift_events()]
    assert "dwell" in declined[-1].reason and "declined" in declined[-1].reason


def test_sensor_shifts_ahead_of_a_forecast_rise(tmp_path, store_res):
    from flexpipe_dag.control.service import evaluate_gear_shift

    db = store_res.get_store()
    cfg = tmp_path / "control.yaml"
    cfg.write_text("controller:\n  forecast_horizon_s: 600\n")
    db.write_samples("live", _samples("latency-1s", [2.0] * 4))  # inside latency-1s's 5 req/s
    ev = evaluate_gear_shift(db, None, resolve_control_settings(str(cfg)), forecast=lambda t, q, h: 12.0)
    assert ev.decision.action == "shift" and ev.decision.trigger == "forecast_above_envelope"
    assert ev.run_key.startswith("gear-shift:latency-1s->throughput-2s@t")
    stored = db.get_shift_event(ev.event_id)
    assert stored.trigger == "forecast_above_envelope" and "forecast rps 12/s" in stored.reason
    # without a forecast passed, the sensor reads the bundled tide history; the seeds (horizon 0) ignore it
    _, cursor = _tick(gear_shift_sensor, store_res, config_file=str(cfg))
    assert parse_cursor(read_fleet_shift_cursor(cursor)["live"])[0].forecast_rps is not None
    _, cursor = _tick(gear_shift_sensor, store_res)
    assert parse_cursor(read_fleet_shift_cursor(cursor)["live"])[0].forecast_rps is None


def test_tide_history_forecast_places_samples_in_tide_time():
    from flexpipe_dag.control.service import tide_history_forecast, tide_time_s
    from flexpipe_dag.control.tide import TideForecaster
    from flexpipe_dag.workload.bundled import load_tide_trace

    epoch, compression = 1_800_000_000.0, 24.0
    fc = tide_history_forecast(TideConfig(), newest_t_s=500.0, epoch_s=epoch)  # tide settings: 1x
    ref = TideForecaster(load_tide_trace())
    # a sample 100 s older than the newest one is 100 s before now
    assert fc(400.0, 3.0, 600.0) == pytest.approx(ref.forecast_rps(tide_time_s(epoch - 100.0, 1.0), 3.0, 600.0))
    assert tide_time_s(epoch, compression) == pytest.approx((epoch * compression) % 86400.0)


def test_gear_shift_run_waits_for_the_live_pipeline(store_res):
    db = store_res.get_store()
    applied = []

    db.write_samples("live", _samples("latency-1s", [2.0]))  # the live serving run a shift by hand is addressed to

    def live_pipeline():  # the serving process's side of the protocol
        ev = wait_until(lambda: db.pending_shift_requests("live"), 20, "the gear_shift run to post its shift request",
                        interval_s=0.1)[0]
        assert db.claim_shift_request(ev.id, "live")
        applied.append(ev.to_gear_key)
        db.update_shift_event(ev.id, "done", {"outcome": "switched"})

    server = BackgroundThread(live_pipeline, name="live-pipeline")
    server.start()
    result = gear_shift.execute_in_process(
        run_config={"ops": {"apply_gear_shift": {"config": {"to_gear_id": "throughput-2s", "timeout_s": 20}}}},
        resources={"store": store_res})
    server.join_or_fail(30)
    assert result.success and applied == ["throughput-2s"]
    assert db.shift_events()[-1].status == "done"


def test_gear_shift_run_fails_clearly_without_a_live_pipeline(store_res):
    result = gear_shift.execute_in_process(
        run_config={"ops": {"apply_gear_shift": {"config": {"to_gear_id": "throughput-2s", "timeout_s": 1.5}}}},
        resources={"store": store_res}, raise_on_error=False)
    assert not result.success and not store_res.get_store().shift_events()  # nothing to address it to
    # a serving run that never takes the request: it expires at its deadline
    store_res.get_store().write_samples("live", _samples("latency-1s", [2.0]))
    result = gear_shift.execute_in_process(
        run_config={"ops": {"apply_gear_shift": {"config": {"to_gear_id": "throughput-2s", "timeout_s": 10,
                                                            "pickup_deadline_s": 1.0}}}},
        resources={"store": store_res}, raise_on_error=False)
    assert not result.success
    ev = store_res.get_store().shift_events()[-1]
    assert ev.status == "expired" and "no live serving run took the shift by its deadline" in ev.details["error"]


def test_tide_admits_in_trough_and_sensor_pauses_on_rise(store_res):
    from flexpipe_dag.control.service import evaluate_tide
    from flexpipe_dag.control.tide import TideForecaster
    from flexpipe_dag.workload.bundled import load_tide_trace

    db = store_res.get_store()
    job_id = db.get_or_create_job("offline-1", "batch", config={"job_key": "offline-1", "trace": "azure-conv",
                                                               "num_requests": 8})
    db.write_samples("live", _samples("throughput-2s", [1.0] * 3))  # far below its 40 req/s capacity
    forecaster = TideForecaster(load_tide_trace())
    trough_s = min(range(0, 86400, 600), key=forecaster.profile_at)  # the real tide's quietest window
    cursor = None
    needed = ControlSettings().tide_config().hysteresis_samples  # consecutive evaluations an admission needs
    assert needed > 1  # else the loop below would not show the hysteresis
    for _ in range(needed):
        assert db.job_status(job_id) == "queued"
        ev = evaluate_tide(db, cursor, TideConfig(), epoch_s=float(trough_s), forecaster=forecaster)
        cursor = ev.cursor
    assert ev.decision.action == "admit", ev.decision.reason
    assert [j.job_key for j in ev.admit] == ["offline-1"] and ev.run_keys["offline-1"] == "batch:offline-1:admission-1"
    assert db.job_status(job_id) == "admitted"
    db.update_job(job_id, status="running")  # the batch run started
    db.write_samples("live", _samples("throughput-2s", [39.0] * 6, t0=10.0))  # the tide rises: online first
    cursor = ev.cursor
    for _ in range(needed):  # the pause needs as many
        result, cursor = _tick(tide_sensor, store_res, cursor)
    assert isinstance(result, SkipReason) and "paused offline-1" in str(result.skip_message)
    assert db.job_status(job_id) == "paused"


def test_bad_control_file_names_file_and_field(tmp_path, store_res):
    from flexpipe_dag.core.errors import InputError

    bad = tmp_path / "control.yaml"
    bad.write_text("controller:\n  ema_alpha: 3\n")
    with pytest.raises(InputError, match=r"controller\.ema_alpha"):
        ControlSettings(config_file=str(bad)).controller_config()
    with pytest.raises(InputError, match=rf"^{re.escape(str(bad))}: controller\.ema_alpha: "):
        resolve_control_settings(str(bad))


def test_gear_health_asset_lists_open_tags(store_res):
    from dagster import materialize

    from flexpipe_dag.assets.health import gear_health

    db = store_res.get_store()
    db.mark_unhealthy("throughput-2s", "seed-cluster", "SmolLM2-135M", "oom", "stage 1 OOM at micro-batch 32")
    db.mark_unhealthy("latency-1s", "seed-cluster", "SmolLM2-135M", "timeout", "stage 0 hung")
    db.clear_health("profile refreshed", model_name="nope")  # clears nothing
    result = materialize([gear_health], resources={"store": store_res})
    meta = result.asset_materializations_for_node("gear_health")[0].metadata
    assert meta["unhealthy_gears"].value == 2 and "OOM" in meta["tags"].value
