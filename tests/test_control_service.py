"""The decision services with plain config objects and a plain in-memory store (no Dagster, no SQL); the control
settings resolved once and reused across sensor evaluations."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from flexpipe_dag.control.config import ControllerConfig
from flexpipe_dag.control.cursor import make_cursor, parse_cursor
from flexpipe_dag.control.service import (
    ControlStore,
    GearShiftStore,
    TideEvaluation,
    TideStore,
    evaluate_gear_shift,
    evaluate_tide,
    shift_run_key,
)
from flexpipe_dag.control.settings import (
    ResolvedControlSettings,
    resolve_control_settings,
)
from flexpipe_dag.control.tide import TideConfig, TideForecaster
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.metrics import MetricSample, StageSample
from tests.support import EXAMPLES, REPO, enveloped_gear

GEARS = [enveloped_gear("latency-1s", "latency", 0.0, 5.0, 1), enveloped_gear("throughput-2s", "throughput", 3.5, 40.0, 2)]


def _samples(gear_id, rps_values, t0=0.0):
    return [MetricSample(t_s=t0 + 2.0 * (i + 1), gear_id=gear_id, source="live", rps=q, completed=int(q * 2),
                         tokens_per_s=q * 100, queue_length=5, running=8, kv_used_fraction=0.3,
                         ttft_p99_ms=300.0, tpot_p99_ms=40.0,
                         stages=(StageSample(0, 0.8, 1, 10, 100),)) for i, q in enumerate(rps_values)]


class MemoryStore:
    """Just the methods the services call (the ControlStore protocol), in memory."""

    def __init__(self, gears=GEARS):
        self.gears = list(gears)
        self.samples: list[tuple[int, str, MetricSample]] = []
        self.events: list[dict] = []
        self.batch: list[SimpleNamespace] = []

    def write(self, run_key, samples):
        for smp in samples:
            self.samples.append((len(self.samples) + 1, run_key, smp))

    # -- the protocol ----------------------------------------------------------------------------
    def latest_sample_run_key(self):
        return self.samples[-1][1] if self.samples else None

    def newest_sample_id(self):
        return self.samples[-1][0] if self.samples else None

    def latest_shiftable_run_key(self):  # every run here is a live serving run
        return self.latest_sample_run_key()

    def recent_shiftable_run_keys(self):  # newest writer first
        return list(dict.fromkeys(rk for _, rk, _ in reversed(self.samples)))

    def pipeline_liveness(self, run_key):
        import time

        from flexpipe_dag.core.liveness import PipelineLiveness

        mine = [(i, s) for i, rk, s in self.samples if rk == run_key]
        return PipelineLiveness(run_key, newest_sample_id=mine[-1][0] if mine else None,
                                newest_sample_t_s=mine[-1][1].t_s if mine else None,
                                newest_sample_written_s=time.time() if mine else None)

    def read_samples(self, *, run_key=None, after_id=None, limit=None, online_only=False):  # all runs are online
        rows = [(i, s) for i, rk, s in self.samples
                if (run_key is None or rk == run_key) and (after_id is None or i > after_id)]
        return rows[:limit] if limit is not None else rows

    def read_run_samples(self, *, after_id=None, limit=None, online_only=False, written_after_s=None):
        # all runs are online; every sample was written just now (written_after_s keeps them all)
        rows = [(i, rk, s) for i, rk, s in self.samples if after_id is None or i > after_id]
        return rows if limit is None else rows[:limit]

    def list_profile_versions(self):
        return [SimpleNamespace(id=1)]

    def load_gears(self, profile_version_id=None):
        return list(self.gears)

    def load_gear(self, gear_key):
        return next((g for g in self.gears if g.gear_id == gear_key), None)

    def latest_profile(self):
        return None  # no profile: the controller's default migration cost

    def unhealthy_gear_keys(self):
        return set()

    def record_shift_event(self, action, status, reason, **fields):
        self.events.append({"action": action, "status": status, "reason": reason, **fields})
        return len(self.events)

    def jobs(self, *, kind=None, statuses=None):
        return [j for j in self.batch if (kind is None or j.kind == kind) and (statuses is None or j.status in statuses)]

    def update_job(self, job_id, **fields):
        job = next(j for j in self.batch if j.id == job_id)
        for k, v in fields.items():
            setattr(job, k, v)

    def transition_job(self, job_id, status, from_statuses, **fields):
        job = next(j for j in self.batch if j.id == job_id)
        if job.status not in from_statuses:
            return False
        self.update_job(job_id, status=status, **fields)
        return True


def test_memory_store_and_sql_store_satisfy_the_protocols(tmp_path):
    from flexpipe_dag.sql.store import Store

    for db in (MemoryStore(), Store.from_url(f"sqlite:///{tmp_path / 'fp.db'}")):
        assert isinstance(db, GearShiftStore) and isinstance(db, TideStore) and isinstance(db, ControlStore)
    assert not isinstance(object(), GearShiftStore)


def test_gear_shift_service_takes_plain_config_objects():
    db = MemoryStore()
    settings = ResolvedControlSettings()  # the seeds
    db.write("live", _samples("latency-1s", [2.0, 2.0]))
    ev = evaluate_gear_shift(db, None, settings)
    assert ev.decision is not None and ev.decision.action != "shift" and ev.run_key is None and not db.events
    db.write("live", _samples("latency-1s", [12.0] * 6, t0=4.0))  # far above latency-1s's 5 req/s
    ev2 = evaluate_gear_shift(db, ev.cursor, settings, run_key_prefix="serve-1:")
    d = ev2.decision
    assert d.action == "shift" and d.trigger == "rps_above_envelope" and d.to_gear_id == "throughput-2s"
    assert ev2.run_key == "serve-1:" + shift_run_key(d) and ev2.run_key.startswith("serve-1:gear-shift:latency-1s->")
    assert ev2.event_id == 1 and db.events[0]["status"] == "decided" and db.events[0]["reason"] == d.reason
    assert db.events[0]["migration_cost_s"] == ControllerConfig().default_migration_cost_s  # no profile stored
    # the cursor keeps the followed run and the last row read: nothing new, no decision
    state, last_id, run_key = parse_cursor(ev2.cursor)
    assert (last_id, run_key) == (8, "live") and state is not None
    assert make_cursor(state, last_id, run_key) == ev2.cursor
    ev3 = evaluate_gear_shift(db, ev2.cursor, settings)
    assert ev3.decision is None and ev3.summary == "no new metric samples" and len(db.events) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev3.cursor = ""  # type: ignore[misc]


def test_gear_shift_service_reads_the_dwell_and_forecast_from_the_settings():
    db = MemoryStore()
    db.write("live", _samples("latency-1s", [2.0] * 4))  # inside latency-1s's envelope
    ev = evaluate_gear_shift(db, None, ResolvedControlSettings(controller=ControllerConfig(forecast_horizon_s=600)),
                             forecast=lambda t, q, h: 12.0)
    assert ev.decision.action == "shift" and ev.decision.trigger == "forecast_above_envelope"
    # the shift was taken: a fall below the new gear's envelope inside the dwell is declined, with the dwell named
    db.write("live", _samples("throughput-2s", [0.5] * 8, t0=20.0))
    ev2 = evaluate_gear_shift(db, ev.cursor, ResolvedControlSettings())
    assert ev2.decision.declined and "dwell" in ev2.decision.reason and db.events[-1]["status"] == "declined"
    assert ev2.run_key is None and ev2.event_id == len(db.events)
    # with no dwell, the same fall shifts back
    db2 = MemoryStore()
    db2.write("live", _samples("latency-1s", [12.0] * 6))
    settings = ResolvedControlSettings(controller=ControllerConfig(dwell_s=0.0))
    first = evaluate_gear_shift(db2, None, settings)
    db2.write("live", _samples("throughput-2s", [0.5] * 8, t0=20.0))
    back = evaluate_gear_shift(db2, first.cursor, settings)
    assert back.decision.action == "shift" and back.decision.to_gear_id == "latency-1s"


def test_tide_service_takes_plain_config_objects():
    from flexpipe_dag.workload.bundled import load_tide_trace

    db = MemoryStore()
    db.batch = [SimpleNamespace(id=7, job_key="offline-1", kind="batch", status="queued", config={"num_requests": 8},
                                admissions=0),
                SimpleNamespace(id=8, job_key="no-config", kind="batch", status="queued", config={}, admissions=0)]
    ev = evaluate_tide(db, None, TideConfig())
    assert ev == TideEvaluation(None, "{}") and ev.run_keys == {}  # no online sample yet
    db.write("live", _samples("throughput-2s", [1.0] * 3))  # far below its 40 req/s capacity
    forecaster = TideForecaster(load_tide_trace())
    trough_s = min(range(0, 86400, 600), key=forecaster.profile_at)
    cursor = None
    for _ in range(2):  # hysteresis 2 here
        ev = evaluate_tide(db, cursor, TideConfig(hysteresis_samples=2), epoch_s=float(trough_s),
                           forecaster=forecaster)
        cursor = ev.cursor
    assert ev.decision.action == "admit" and [j.job_key for j in ev.admit] == ["offline-1"]
    assert ev.run_keys == {"offline-1": "batch:offline-1:admission-1"} and ev.paused == ()
    assert db.batch[0].status == "admitted" and db.batch[1].status == "queued"
    assert db.batch[0].admissions == 1 and "admissions" not in json.loads(ev.cursor)  # counted in the job row
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.run_keys = {}  # type: ignore[misc]
    # online rises to the gear's capacity: the running job is paused after the hysteresis
    db.batch[0].status = "running"
    db.write("live", _samples("throughput-2s", [39.0] * 6, t0=10.0))
    for _ in range(2):
        ev = evaluate_tide(db, cursor, TideConfig(hysteresis_samples=2), epoch_s=float(trough_s),
                           forecaster=forecaster)
        cursor = ev.cursor
    assert ev.decision.action == "pause" and ev.paused == ("offline-1",) and ev.admit == () and ev.run_keys == {}
    assert db.batch[0].status == "paused"
    with pytest.raises(InputError, match="tide_sensor cursor"):
        evaluate_tide(db, "not json", TideConfig())


def test_resolve_control_settings_overrides_and_errors(tmp_path):
    cfg = tmp_path / "control.yaml"
    cfg.write_text("controller:\n  dwell_s: 120\n  target_p99_ms: 800\ntide:\n  horizon_s: 600\n")
    resolved = resolve_control_settings(str(cfg))
    assert resolved.controller.dwell_s == 120.0 and resolved.controller.target_p99_ms == 800.0
    assert resolved.tide.horizon_s == 600.0 and resolved.source == str(cfg)
    over = resolve_control_settings(str(cfg), target_p99_ms=500.0, dwell_s=0.0)  # 0 s is a dwell, not "unset"
    assert over.controller.dwell_s == 0.0 and over.controller.target_p99_ms == 500.0
    assert resolve_control_settings().controller == ControllerConfig() and resolve_control_settings().tide == TideConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.controller = ControllerConfig()  # type: ignore[misc]
    with pytest.raises(InputError, match=r"^control settings: controller\.dwell_s: "):
        resolve_control_settings(dwell_s=-1.0)  # no sentinel: a negative dwell is refused
    cfg.write_text("tide:\n  admit_below_fraction: 0.9\n  pause_above_fraction: 0.5\n")
    with pytest.raises(InputError, match="pause_above_fraction must exceed"):
        resolve_control_settings(str(cfg))
    # figures are strict: a quoted number or a fractional count is refused, naming the file and the field
    cfg.write_text('controller:\n  dwell_s: "120"\n')
    with pytest.raises(InputError, match=rf"^{re.escape(str(cfg))}: controller\.dwell_s: Input should be a valid number"):
        resolve_control_settings(str(cfg))
    cfg.write_text("tide:\n  hysteresis_samples: 3.0\n  horizon_s: '600'\n")
    with pytest.raises(InputError, match=r"tide\.horizon_s: .*valid number; also tide\.hysteresis_samples: .*valid integer"):
        resolve_control_settings(str(cfg))
    cfg.write_text("gears: {}\n")
    with pytest.raises(InputError, match="expected a mapping with 'controller' and/or 'tide' sections"):
        resolve_control_settings(str(cfg))
    with pytest.raises(InputError, match="cannot read controller config"):
        resolve_control_settings(str(tmp_path / "missing.yaml"))


def test_control_file_is_read_once_across_sensor_evaluations(tmp_path, monkeypatch):
    from dagster import DagsterInstance, RunRequest, build_sensor_context

    import flexpipe_dag.control.settings as settings_mod
    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.jobs.gear_shift import gear_shift_sensor
    from flexpipe_dag.jobs.tide import tide_sensor
    from flexpipe_dag.resources.control import ControlSettings
    from flexpipe_dag.resources.store_resource import StoreResource

    reads = []
    real_read = settings_mod.read_control_file
    monkeypatch.setattr(settings_mod, "read_control_file", lambda path: reads.append(path) or real_read(path))
    cfg = tmp_path / "control.yaml"
    cfg.write_text("controller:\n  dwell_s: 0\n")
    loaded = ControlSettings(config_file=str(cfg)).resolved()  # what the code location does when it loads
    assert reads == [str(cfg)] and loaded.controller.dwell_s == 0.0
    # Dagster builds a fresh resource object for every evaluation: the resolved figures are the same object
    assert ControlSettings(config_file=str(cfg)).resolved() is loaded
    cfg.write_text("controller: [not, read, again]\n")  # a later edit is not re-parsed by a tick

    store_res = StoreResource(database_url=f"sqlite:///{tmp_path / 'fp.db'}")
    db = store_res.get_store()
    info = db.save_profile(load_cluster_profile(EXAMPLES / "seed_example.yaml"))
    db.save_gears(GEARS, info.id, db.save_model("SmolLM2-135M", "bf16", 30, {"layers": 30}))
    cursor, tide_cursor, results = None, None, []
    for t0 in (0.0, 20.0, 40.0):
        db.write_samples("live", _samples("latency-1s", [12.0] * 3, t0=t0))
        for sensor in (gear_shift_sensor, tide_sensor):
            ctx = build_sensor_context(instance=DagsterInstance.ephemeral(),
                                       cursor=cursor if sensor is gear_shift_sensor else tide_cursor,
                                       resources={"store": store_res, "control": ControlSettings(config_file=str(cfg))})
            results.append(sensor(ctx))
            if sensor is gear_shift_sensor:
                cursor = ctx.cursor
            else:
                tide_cursor = ctx.cursor
    assert reads == [str(cfg)], reads  # six evaluations, one read
    assert any(isinstance(r, RunRequest) for r in results)


def test_control_layer_imports_no_dagster_and_no_sql():
    code = ("import sys, flexpipe_dag.control.service, flexpipe_dag.control.settings, flexpipe_dag.control.cursor; "
            "print(sorted(m for m in ('dagster', 'sqlalchemy', 'flexpipe_dag.sql', 'flexpipe_dag.jobs', "
            "'flexpipe_dag.resources') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_tide_cursor_reads_the_old_qps_name_and_names_bad_fields():
    from flexpipe_dag.control.cursor import TideCursor

    old = json.dumps({"qps_ema": 3.0, "last_sample_id": 7, "admissions": {"j": 1},
                      "gate": {"running": False, "pending": None, "count": 0}, "gear_id": "g"})
    cur = TideCursor.parse(old)
    assert (cur.ema_rps, cur.last_sample_id, cur.admissions, cur.gear_id) == (3.0, 7, {"j": 1}, "g")
    # the one-stream gear is read and dropped: each run's part starts afresh from its next samples
    assert TideCursor.parse(cur.dump()) == cur.model_copy(update={"gear_id": None}) and "gear_id" not in cur.dump()
    for bad, field in (("[1]", None), ('{"last_sample_id": "x"}', "last_sample_id"), ('{"gate": 5}', "gate"),
                       ('{"runs": {"r": {"ema_rps": -1}}}', "runs.r.ema_rps"),
                       ('{"runs": {"r": {"ema_rps": 1, "instances": 0}}}', "runs.r.instances"),
                       ('{"admissions": [1, 2]}', "admissions"), ('{"ema_rps": -1}', "ema_rps"),
                       ('{"qps_ema": 1, "ema_rps": 2}', "ema_rps")):
        with pytest.raises(InputError, match="tide_sensor cursor") as err:
            TideCursor.parse(bad)
        assert field is None or field in str(err.value)


def test_the_tide_reads_the_online_stream_not_a_batch_jobs_own_samples(tmp_path):
    """A ``batch_inference`` run writes the samples of its own pipeline (no online arrival: ``rps`` 0). Read
    with the online server's, they pulled the smoothed online rate towards 0, so a rise never paused the
    batch, and the newest sample's gear (the batch job's) set the capacity."""
    from flexpipe_dag.core.status import PipelineRunKind
    from flexpipe_dag.sql.store import Store
    from flexpipe_dag.workload.bundled import load_tide_trace

    sql = Store.from_url(f"sqlite:///{tmp_path / 'fp.db'}")
    gears = MemoryStore()
    gears.batch = [SimpleNamespace(id=7, job_key="offline-1", kind="batch", status="running",
                                   config={"num_requests": 8}, admissions=1)]
    db = SimpleNamespace(read_run_samples=sql.read_run_samples, newest_sample_id=sql.newest_sample_id,
                         pipeline_liveness=sql.pipeline_liveness, load_gear=gears.load_gear, jobs=gears.jobs,
                         update_job=gears.update_job, transition_job=gears.transition_job)
    sql.heartbeat_pipeline_run("serve-1", PipelineRunKind.SERVE, "throughput-2s")
    sql.heartbeat_pipeline_run("batch-run", PipelineRunKind.BATCH, "latency-1s")
    for online, offline in zip(_samples("throughput-2s", [35.0] * 6), _samples("latency-1s", [0.0] * 6)):
        sql.write_samples("serve-1", [online])  # 35 of 40 req/s: above the 75 % pause line
        sql.write_samples("batch-run", [offline])
    forecaster = TideForecaster(load_tide_trace())
    trough_s = float(min(range(0, 86400, 600), key=forecaster.profile_at))
    cursor = None
    for _ in range(2):
        ev = evaluate_tide(db, cursor, TideConfig(hysteresis_samples=2), epoch_s=trough_s, forecaster=forecaster)
        cursor = ev.cursor
    assert ev.decision.ema_rps == pytest.approx(35.0) and ev.decision.capacity_rps == 40.0
    assert ev.decision.action == "pause" and ev.paused == ("offline-1",)
    assert len(sql.read_samples()) == 12 and len(sql.read_samples(online_only=True)) == 6


def _sql_tide_store(sql, gears):
    """The TideStore protocol over a real SQLite store's samples and runs, with gears and jobs in memory."""
    return SimpleNamespace(read_run_samples=sql.read_run_samples, newest_sample_id=sql.newest_sample_id,
                           pipeline_liveness=sql.pipeline_liveness, load_gear=gears.load_gear, jobs=gears.jobs,
                           update_job=gears.update_job, transition_job=gears.transition_job)


def test_the_tide_adds_up_the_live_serving_runs_and_drops_those_that_left(tmp_path):
    """Two servers share one store. Read as one stream, their samples interleaved: the tide smoothed one run's
    rate (15 req/s, not the fleet's 30) against one gear's capacity, and after the last server ended it kept its
    last rate for ever. Each run is now smoothed on its own; the live ones add up (rates and capacities), and a run
    that ended or fell silent leaves both sums."""
    from flexpipe_dag.core.status import PipelineRunKind
    from flexpipe_dag.sql.store import Store
    from flexpipe_dag.workload.bundled import load_tide_trace

    sql = Store.from_url(f"sqlite:///{tmp_path / 'fp.db'}")
    gears = MemoryStore()
    gears.batch = [SimpleNamespace(id=7, job_key="offline-1", kind="batch", status="running",
                                   config={"num_requests": 8}, admissions=1)]
    db = _sql_tide_store(sql, gears)
    for run_key in ("serve-a", "serve-b"):
        sql.heartbeat_pipeline_run(run_key, PipelineRunKind.SERVE, "throughput-2s")
    for a, b in zip(_samples("throughput-2s", [35.0] * 6), _samples("throughput-2s", [10.0] * 6)):
        sql.write_samples("serve-a", [a])
        sql.write_samples("serve-b", [b])
    forecaster = TideForecaster(load_tide_trace())
    trough_s = float(min(range(0, 86400, 600), key=forecaster.profile_at))
    cfg = TideConfig(hysteresis_samples=1)

    def step(cursor, **kw):
        return evaluate_tide(db, cursor, cfg, epoch_s=trough_s, forecaster=forecaster, **kw)

    ev = step(None)  # 45 of 80 req/s: under the 75 % pause line (one stream read about 22 of 40)
    assert ev.decision.ema_rps == pytest.approx(45.0) and ev.decision.capacity_rps == 80.0
    assert ev.decision.action == "keep" and "2 serving runs together" in ev.decision.reason
    assert set(json.loads(ev.cursor)["runs"]) == {"serve-a", "serve-b"} and ev.runs_left == ()
    sql.end_pipeline_run("serve-b")  # the fleet's rate and capacity are serve-a's alone: 35 of 40, paused
    ev = step(ev.cursor)
    assert ev.decision.ema_rps == pytest.approx(35.0) and ev.decision.capacity_rps == 40.0
    assert ev.decision.action == "pause" and ev.paused == ("offline-1",)
    assert len(ev.runs_left) == 1 and "serve-b ended" in ev.runs_left[0]
    assert ev.runs_left[0].endswith("its rate leaves the online tide")
    assert list(json.loads(ev.cursor)["runs"]) == ["serve-a"]
    # serve-a falls silent (its newest sample and heartbeat older than the freshness bound): nothing online is live
    ev = step(ev.cursor, now_s=time.time() + 121.0, freshness_s=120.0)
    assert "serve-a" in ev.runs_left[0] and "freshness bound" in ev.runs_left[0]
    assert ev.decision.ema_rps == 0.0 and ev.decision.action == "admit" and "no serving run is live" in ev.decision.reason
    assert json.loads(ev.cursor)["runs"] == {} and gears.batch[0].status == "admitted"
    ev = step(ev.cursor)  # with no new sample, nothing comes back: the gate keeps the admission
    assert ev.decision.action == "keep" and ev.runs_left == ()
    # a new server's samples bring the tide back
    sql.heartbeat_pipeline_run("serve-c", PipelineRunKind.SERVE, "throughput-2s")
    sql.write_samples("serve-c", _samples("throughput-2s", [38.0] * 3, t0=100.0))
    gears.batch[0].status = "running"
    ev = step(ev.cursor)
    assert ev.decision.ema_rps == pytest.approx(38.0) and ev.decision.action == "pause"


def test_the_gear_shift_sensor_cursor_keeps_one_cursor_per_run_and_names_bad_fields():
    from flexpipe_dag.control.cursor import make_fleet_shift_cursor, read_fleet_shift_cursor

    one = make_cursor(None, 7, "serve-a")
    assert read_fleet_shift_cursor(None) == read_fleet_shift_cursor("") == {}
    assert read_fleet_shift_cursor(one) == {"serve-a": one}  # written when the sensor followed one run
    assert read_fleet_shift_cursor(make_cursor(None, None, None)) == {}
    both = {"serve-a": one, "serve-b": make_cursor(None, 9, "serve-b")}
    assert read_fleet_shift_cursor(make_fleet_shift_cursor(both)) == both
    for bad, field in (("[1]", None), ('{"runs": 5}', "runs"), ('{"runs": {}, "x": 1}', "runs"),
                       ('{"runs": {"serve-a": 5}}', "runs.serve-a"),
                       (json.dumps({"runs": {"serve-b": one}}), "runs.serve-b")):
        with pytest.raises(InputError, match="gear_shift_sensor cursor") as err:
            read_fleet_shift_cursor(bad)
        assert field is None or field in str(err.value)


def test_a_control_file_whose_tide_history_is_bad_is_refused_when_read(tmp_path):
    """The history was read only at the first forecast, and a failed forecast is skipped: forecasting was silently
    off. It is read with the control file now, its bad row named."""
    history = tmp_path / "hist.csv"
    history.write_text("window_start_s,total_rate_req_per_s\n0,-5\n600,1\n")
    control = tmp_path / "control.yaml"
    control.write_text(f"tide:\n  history_file: {history}\n")
    with pytest.raises(InputError, match=r"control.yaml: tide.history_file: .*hist.csv: row 1.total_rate_req_per_s: "
                                         r"got -5.0; expected a rate >= 0"):
        resolve_control_settings(str(control))
    control.write_text(f"tide:\n  history_file: {tmp_path / 'missing.csv'}\n")
    with pytest.raises(InputError, match="tide.history_file: .*missing.csv"):
        resolve_control_settings(str(control))
