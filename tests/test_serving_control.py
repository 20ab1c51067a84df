"""The serve loop's control steps call the control service with the resolved settings (no Dagster resource)."""

from __future__ import annotations

from types import SimpleNamespace

from flexpipe_dag.control.config import ControllerConfig
from flexpipe_dag.control.settings import ResolvedControlSettings
from flexpipe_dag.control.tide import TideConfig, TideForecaster
from flexpipe_dag.serving.serve import ServeSettings, TraceServer
from tests.support import EXAMPLES
from tests.test_control_service import GEARS, _samples


class _Executor:
    """Applies every shift at once (no pipeline)."""

    def __init__(self):
        self.applied = []

    def shift(self, gear):
        self.applied.append(gear.gear_id)
        return SimpleNamespace(status="done", reason="switched", timings_s={"total": 0.0}, mode="test",
                               requests_moved=0, unhealthy_gear_id=None, failure_kind=None,
                               to_details=lambda: {"mode": "test"})


def _store(tmp_path):
    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.sql.store import Store

    db = Store.from_url(f"sqlite:///{tmp_path / 'fp.db'}")
    info = db.save_profile(load_cluster_profile(EXAMPLES / "seed_example.yaml"))
    db.save_gears(GEARS, info.id, db.save_model("SmolLM2-135M", "bf16", 30, {"layers": 30}))
    return db


def test_serve_loop_shifts_through_the_control_service(tmp_path):
    db = _store(tmp_path)
    executor = _Executor()
    settings = ServeSettings(run_key="serve-1", online_job_key="serve-1-online")
    server = TraceServer(db, ResolvedControlSettings(controller=ControllerConfig(dwell_s=0.0)),
                         SimpleNamespace(active=None), executor, GEARS, settings, log=lambda line: None)
    db.write_samples("other-run", _samples("latency-1s", [12.0] * 6))  # not this serve run's: ignored
    server._control_step()
    assert server._shift_thread is None and not db.shift_events()
    db.write_samples("serve-1", _samples("latency-1s", [12.0] * 6))  # far above latency-1s's 5 req/s
    server._control_step()
    server._shift_thread.join(10)
    assert executor.applied == ["throughput-2s"]
    (ev,) = db.shift_events()
    assert ev.status == "done" and ev.trigger == "rps_above_envelope"
    assert ev.details["run_key"].startswith("serve-1:gear-shift:latency-1s->throughput-2s@t")
    assert server.report.shifts[0]["status"] == "done"


def test_serve_loop_admits_offline_work_with_the_resolved_tide_figures(tmp_path):
    from flexpipe_dag.workload.bundled import load_tide_trace

    db = _store(tmp_path)
    online = db.get_or_create_job("serve-1-online", "online")
    offline = db.get_or_create_job("serve-1-offline", "batch")
    forecaster = TideForecaster(load_tide_trace())
    trough_s = min(range(0, 86400, 600), key=forecaster.profile_at)
    settings = ServeSettings(run_key="serve-1", online_job_key="serve-1-online", offline_job_key="serve-1-offline",
                             tide_start_s=float(trough_s))
    server = TraceServer(db, ResolvedControlSettings(tide=TideConfig(hysteresis_samples=2)),
                         SimpleNamespace(active=None), _Executor(), GEARS, settings, forecaster=forecaster,
                         log=lambda line: None)
    server._jobs = {"online": online, "offline": offline}
    server._tide_step(0.0)
    assert not server._gate.running and db.job_status(offline) == "queued"  # 1 of the 2 evaluations required
    server._tide_step(0.0)
    assert server._gate.running and db.job_status(offline) == "running"
    assert [d["action"] for d in server.report.tide_decisions] == ["admit"]
