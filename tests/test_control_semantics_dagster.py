"""Control-loop semantics at production scale (issue #16, items 4-6): the tide sensor's cursor stays bounded
while run keys stay unique per admission; the refresh schedule's crons are checked, may be a list, and a
cron change never backfills (Dagster's own scheduler tick code over a test instance); the ops that start the
pipeline runtime share one pool, limited to 1 by the shipped ``dagster.yaml``, so two queued runs take turns.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from dagster import (
    DagsterInstance,
    DefaultScheduleStatus,
    Definitions,
    ScheduleDefinition,
    build_schedule_context,
    instance_for_test,
    job,
    load_assets_from_modules,
    op,
)

from flexpipe_dag.control.cursor import RunTide, TideCursor
from flexpipe_dag.control.service import evaluate_tide
from flexpipe_dag.control.tide import TideConfig, TideForecaster
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.liveness import PipelineLiveness
from flexpipe_dag.core.metrics import MetricSample, StageSample
from flexpipe_dag.jobs.cron import LATE_TICK_LIMIT_S, late_tick_reason
from flexpipe_dag.jobs.pools import PIPELINE_RUNTIME_POOL, initialise_pools
from flexpipe_dag.jobs.profiling import profile_refresh_crons, profile_refresh_job, profile_refresh_schedule
from flexpipe_dag.runtime.host_lock import hold_runtime_lock
from flexpipe_dag.workload.bundled import load_tide_trace
from tests.support import REPO, enveloped_gear

UTC = dt.UTC
GEARS = {g.gear_id: g for g in (enveloped_gear("throughput-2s", "throughput", 3.5, 40.0, 2),)}
#: The tide sensor's cursor never exceeds this many bytes with one live serving run, however many jobs it admitted
#: (it keeps no per-job entry; the longest fields are the run key and the gear id, at most 200 characters each like
#: the store's keys); each further live run adds at most TIDE_CURSOR_RUN_BYTES.
TIDE_CURSOR_MAX_BYTES = 640
TIDE_CURSOR_RUN_BYTES = 500


def _samples(rps_values, t0=0.0):
    return [MetricSample(t_s=t0 + 2.0 * (i + 1), gear_id="throughput-2s", source="live", rps=q, completed=int(q * 2),
                         tokens_per_s=q * 100, queue_length=5, running=8, kv_used_fraction=0.3, ttft_p99_ms=300.0,
                         tpot_p99_ms=40.0, stages=(StageSample(0, 0.8, 1, 10, 100),)) for i, q in enumerate(rps_values)]


class JobsInMemory:
    """The TideStore protocol in memory: low online load on one gear, and batch jobs as plain rows."""

    def __init__(self):
        self.samples = list(enumerate(_samples([1.0] * 3), start=1))  # far below the gear's 40 req/s
        self.rows: list[SimpleNamespace] = []

    def add(self, job_key):
        self.rows.append(SimpleNamespace(id=len(self.rows) + 1, job_key=job_key, kind="batch", status="queued",
                                         config={"num_requests": 8}, admissions=0))

    def read_run_samples(self, *, after_id=None, limit=None, online_only=False, written_after_s=None):
        # one online serving run, every sample written just now
        rows = [(i, "serve-1", s) for i, s in self.samples if after_id is None or i > after_id]
        return rows if limit is None else rows[:limit]

    def pipeline_liveness(self, run_key):  # live: its newest sample was just written
        return PipelineLiveness(run_key, kind="serve", newest_sample_id=self.samples[-1][0],
                                newest_sample_written_s=time.time())

    def newest_sample_id(self):
        return self.samples[-1][0] if self.samples else None

    def load_gear(self, gear_key):
        return GEARS.get(gear_key)

    def jobs(self, *, kind=None, statuses=None):
        return [j for j in self.rows if (kind is None or j.kind == kind) and (statuses is None or j.status in statuses)]

    def update_job(self, job_id, **fields):
        for k, v in fields.items():
            setattr(self.rows[job_id - 1], k, v)

    def transition_job(self, job_id, status, from_statuses, **fields):
        job = self.rows[job_id - 1]
        if job.status not in from_statuses:
            return False
        self.update_job(job_id, status=status, **fields)
        return True


@pytest.fixture(scope="module")
def trough():
    """``(forecaster, epoch second of the bundled tide's quietest window)``: the tide admits there."""
    forecaster = TideForecaster(load_tide_trace())
    return forecaster, float(min(range(0, 86400, 600), key=forecaster.profile_at))


# -- 4. the tide cursor is bounded; run keys stay unique per admission -------------------------------------------
def test_tide_cursor_stays_bounded_over_10000_jobs(trough):
    forecaster, trough_s = trough
    db, cfg = JobsInMemory(), TideConfig(hysteresis_samples=1)
    cursor, sizes, run_keys = None, [], []
    for batch in range(100):  # 100 troughs, 100 jobs queued before each: 10,000 jobs admitted and finished
        for k in range(100):
            db.add(f"offline-{batch * 100 + k}")
        ev = evaluate_tide(db, cursor, cfg, epoch_s=trough_s, forecaster=forecaster)
        assert ev.decision.action == "admit" and len(ev.admit) == 100
        run_keys += ev.run_keys.values()
        for j in ev.admit:
            j.status = "done"
        cursor = ev.cursor
        sizes.append(len(cursor.encode()))
    assert len(db.rows) == 10_000 and len(set(run_keys)) == 10_000
    assert run_keys[0] == "batch:offline-0:admission-1" and run_keys[-1] == "batch:offline-9999:admission-1"
    assert max(sizes) <= TIDE_CURSOR_MAX_BYTES and max(sizes) == min(sizes)  # the same size after 100 and 10,000
    assert "admissions" not in json.loads(cursor)
    # the longest cursor: every field at its widest (a 200-character run key and gear id)
    def widest(n_runs):
        part = RunTide(ema_rps=1.2345678901234567e+300, gear_id="g" * 200, instances=2**31)
        return TideCursor(ema_rps=1.2345678901234567e+300, last_sample_id=2**63 - 1,
                          runs={f"{k:0>200}": part for k in range(n_runs)},
                          gate={"running": True, "pending": "pause", "count": 2**31}).dump().encode()
    assert len(widest(1)) <= TIDE_CURSOR_MAX_BYTES
    assert len(widest(3)) <= TIDE_CURSOR_MAX_BYTES + 2 * TIDE_CURSOR_RUN_BYTES
    # a finished job queued again (as the serve loop does) gets a new run key from its own row's count
    db.rows[0].status = "queued"
    ev = evaluate_tide(db, cursor, cfg, epoch_s=trough_s, forecaster=forecaster)
    assert ev.run_keys == {"offline-0": "batch:offline-0:admission-2"} and db.rows[0].admissions == 2


def test_an_api_batch_is_admitted_in_a_trough_but_gets_no_batch_inference_run(trough):
    """A Batch API batch (served by the front door on its own pipeline) follows the tide's status changes
    like any batch job, but the sensor launches no batch_inference run for it."""
    from flexpipe_dag.core.status import API_BATCH_CONFIG_KEY

    forecaster, trough_s = trough
    db = JobsInMemory()
    db.add("offline-1")
    db.add("batch_abc")
    db.rows[1].config = {API_BATCH_CONFIG_KEY: {"input_file_id": "file-1", "endpoint": "/v1/completions"}}
    ev = evaluate_tide(db, None, TideConfig(hysteresis_samples=1), epoch_s=trough_s, forecaster=forecaster)
    assert ev.decision.action == "admit" and [j.job_key for j in ev.admit] == ["offline-1"]
    assert list(ev.run_keys) == ["offline-1"] and [r.status for r in db.rows] == ["admitted", "admitted"]


def test_sql_store_counts_admissions_across_pause_finish_and_requeue(store, trough):
    forecaster, trough_s = trough
    store.save_gears(list(GEARS.values()), store.save_profile(_lab_profile()).id,
                     store.save_model("SmolLM2-135M", "bf16", 30, {"layers": 30}))
    store.write_samples("live", _samples([1.0] * 3))
    job_id = store.get_or_create_job("offline-1", "batch", config={"job_key": "offline-1", "trace": "azure-conv"})
    cfg = TideConfig(hysteresis_samples=1)
    keys, cursor = [], None
    for then in ("paused", "done", "queued", "done"):  # admitted, paused; admitted again, finished; queued again
        ev = evaluate_tide(store, cursor, cfg, epoch_s=trough_s, forecaster=forecaster)
        keys.append(ev.run_keys.get("offline-1"))
        cursor = ev.cursor
        store.update_job(job_id, status=then)
    # a paused job is admitted again; a finished one is not, until it is queued again
    assert keys == ["batch:offline-1:admission-1", "batch:offline-1:admission-2", None, "batch:offline-1:admission-3"]
    (row,) = store.jobs(kind="batch")
    assert row.admissions == 3 and "admissions" not in json.loads(cursor)


def test_old_cursor_counts_move_into_the_store_and_leave_the_cursor(store, trough):
    forecaster, trough_s = trough
    store.write_samples("live", _samples([1.0] * 3))
    first = store.get_or_create_job("offline-1", "batch", config={"job_key": "offline-1", "trace": "azure-conv"})
    other = store.get_or_create_job("offline-2", "batch", config={"job_key": "offline-2", "trace": "azure-conv"})
    store.update_job(other, status="done")
    old = json.dumps({"qps_ema": 1.0, "last_sample_id": None, "admissions": {"offline-1": 3, "offline-2": 5, "gone": 9},
                      "gate": {"running": False, "pending": None, "count": 0}, "gear_id": None})
    ev = evaluate_tide(store, old, TideConfig(hysteresis_samples=1), epoch_s=trough_s, forecaster=forecaster)
    assert ev.run_keys == {"offline-1": "batch:offline-1:admission-4"}  # never a key the old cursor used
    assert {j.job_key: j.admissions for j in store.jobs(kind="batch")} == {"offline-1": 4, "offline-2": 5}
    assert "admissions" not in json.loads(ev.cursor) and store.job_status(first) == "admitted"


def test_downgrade_below_the_admission_count_names_the_loss(store):
    from flexpipe_dag.sql.store import downgrade

    store.update_job(store.get_or_create_job("offline-1", "batch"), admissions=2)
    with pytest.raises(InputError, match=r"0009 -> 0008: inference_jobs\.admissions, the admission counts of 1 jobs"):
        downgrade(store.engine, "0008")


def _lab_profile():
    from flexpipe_dag.core.cluster import load_cluster_profile

    return load_cluster_profile(REPO / "examples" / "clusters" / "seed_example.yaml")


# -- 5. schedules: crons checked, a list accepted, a cron change never backfills ------------------------------
@pytest.mark.parametrize(("cron", "said"), [
    ("*/90 * * * *", "the minute step 90 is beyond the minute range 0-59: it matches minute 0 only, so the cron "
                     "does not fire every 90 minutes"),
    ("0 */36 * * *", "the hour step 36 is beyond the hour range 0-23: it matches hour 0 only"),
    ("0 0 */45 * *", "the day of month step 45 is beyond the day of month range 1-31"),
    ("0 0 1 */13 *", "the month step 13 is beyond the month range 1-12"),
    ("0 0 * * */8", "the day of week step 8 is beyond the day of week range 0-6"),
    ("0 3-5/4 * * *", "the hour step 4 is beyond the hour range 3-5"),
    ("0 2 * * *; */90 * * * *", "the minute step 90 is beyond the minute range 0-59"),
])
def test_cron_step_beyond_its_field_range_is_refused_naming_the_variable(monkeypatch, cron, said):
    monkeypatch.setenv("FLEXPIPE_PROFILE_REFRESH_CRON", cron)
    with pytest.raises(InputError) as err:
        profile_refresh_schedule()
    message = str(err.value)
    assert message.startswith("environment variable FLEXPIPE_PROFILE_REFRESH_CRON: ") and said in message
    assert "'0 0-21/3 * * *; 30 1-22/3 * * *' (every 90 minutes)" in message and "\n" not in message


@pytest.mark.parametrize(("text", "said"), [
    ("0 2 * * *;", "an empty cron in '0 2 * * *;'"), ("0 2 * * *; 0 2 * * *", "the cron '0 2 * * *' is given twice"),
    ("0 2 * *", "expected a 5-field cron expression such as '0 2 * * *' (several separated by ';'), got '0 2 * *'"),
])
def test_malformed_cron_lists_are_refused(monkeypatch, text, said):
    monkeypatch.setenv("FLEXPIPE_PROFILE_REFRESH_CRON", text)
    with pytest.raises(InputError, match="^environment variable FLEXPIPE_PROFILE_REFRESH_CRON: ") as err:
        profile_refresh_crons()
    assert said in str(err.value)


def test_a_list_of_two_crons_fires_every_90_minutes(monkeypatch):
    from dagster._utils.schedules import schedule_execution_time_iterator

    monkeypatch.setenv("FLEXPIPE_PROFILE_REFRESH_CRON", " 0 0-21/3 * * *;30 1-22/3 * * * ")
    sched = profile_refresh_schedule()
    assert sched.cron_schedule == ["0 0-21/3 * * *", "30 1-22/3 * * *"]
    assert profile_refresh_schedule(["0 0-21/3 * * *", "30 1-22/3 * * *"]).cron_schedule == sched.cron_schedule
    start = dt.datetime(2026, 11, 30, tzinfo=UTC).timestamp() - 1
    times = []
    for t in schedule_execution_time_iterator(start, sched.cron_schedule, "UTC"):
        if len(times) == 17:
            break
        times.append(t.timestamp())
    assert [b - a for a, b in zip(times, times[1:], strict=False)] == [5400.0] * 16  # 16 ticks a day, 90 min apart
    assert dt.datetime.fromtimestamp(times[-1], UTC) == dt.datetime(2026, 12, 1, tzinfo=UTC)


def test_a_tick_runs_on_time_and_a_missed_one_is_skipped():
    from dagster._core.test_utils import freeze_time

    at = dt.datetime(2026, 11, 30, 2, tzinfo=UTC)
    assert late_tick_reason(at.timestamp(), at.timestamp() + LATE_TICK_LIMIT_S) is None
    assert "evaluated 0.2 h late (limit 600 s)" in late_tick_reason(at.timestamp(), at.timestamp() + 601)
    sched = profile_refresh_schedule("0 2 * * *")
    for now, on_time in ((at + dt.timedelta(seconds=30), True), (at + dt.timedelta(hours=11), False)):
        with freeze_time(now):
            data = sched.evaluate_tick(build_schedule_context(scheduled_execution_time=at))
        assert len(data.run_requests or []) == on_time and (data.skip_message is None) == on_time
    assert len(sched.evaluate_tick(build_schedule_context()).run_requests) == 1  # no tick time: a run by hand


#: The code location the scheduler test loads (set by the test before each scheduler iteration).
CODE_LOCATION: Definitions | None = None


def _refresh_location(schedule: ScheduleDefinition) -> Definitions:
    from flexpipe_dag.assets import profiling as profiling_assets
    from flexpipe_dag.definitions import build_resources

    return Definitions(assets=load_assets_from_modules([profiling_assets]), jobs=[profile_refresh_job],
                       schedules=[schedule], resources=build_resources())


def _scheduler_iteration(instance, monkeypatch, schedule: ScheduleDefinition, now: dt.datetime) -> None:
    """One iteration of Dagster's scheduler daemon at ``now``, freshly started (as after a deploy) on a code
    location holding ``schedule``."""
    from dagster._core.remote_origin import InProcessCodeLocationOrigin
    from dagster._core.test_utils import (
        InProcessTestWorkspaceLoadTarget,
        create_test_daemon_workspace_context,
        freeze_time,
    )
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
    from dagster._scheduler.scheduler import launch_scheduled_runs

    monkeypatch.setattr(sys.modules[__name__], "CODE_LOCATION", _refresh_location(schedule))
    origin = InProcessCodeLocationOrigin(LoadableTargetOrigin(module_name=__name__, attribute="CODE_LOCATION",
                                                              working_directory=str(REPO)), location_name="flexpipe")
    with freeze_time(now), create_test_daemon_workspace_context(InProcessTestWorkspaceLoadTarget(origin),
                                                                instance) as context:
        list(launch_scheduled_runs(context, logging.getLogger("scheduler"), now, {}))


def _ticks(instance):
    (state,) = instance.all_instigator_state()
    ticks = instance.get_ticks(state.instigator_origin_id, state.selector_id)
    return [(dt.datetime.fromtimestamp(t.timestamp, UTC), t.status.value, t.skip_reason, len(t.run_ids))
            for t in reversed(ticks)]


@pytest.mark.parametrize("flexpipe", [False, True], ids=["dagster-alone", "flexpipe"])
def test_a_cron_change_never_backfills(monkeypatch, flexpipe):
    """The nightly refresh ran at 02:00; the next day the cron moves to 14:00 and the daemon restarts at 01:00.
    Dagster alone runs "yesterday at 14:00" at once; FlexPipe's schedule skips it and runs at today's 14:00."""
    def schedule(cron):
        if flexpipe:
            return profile_refresh_schedule(cron)
        return ScheduleDefinition(name="profile_refresh_schedule", job=profile_refresh_job, cron_schedule=cron,
                                  execution_timezone="UTC", default_status=DefaultScheduleStatus.RUNNING)

    day = dt.datetime(2026, 11, 30, tzinfo=UTC)
    with instance_for_test() as instance:
        _scheduler_iteration(instance, monkeypatch, schedule("0 2 * * *"), day + dt.timedelta(hours=1, minutes=59))
        _scheduler_iteration(instance, monkeypatch, schedule("0 2 * * *"), day + dt.timedelta(hours=2, seconds=30))
        assert len(instance.get_runs()) == 1  # the nightly run, on time
        _scheduler_iteration(instance, monkeypatch, schedule("0 14 * * *"), day + dt.timedelta(days=1, hours=1))
        backfilled = _ticks(instance)[-1]
        assert backfilled[0] == day + dt.timedelta(hours=14)  # the tick Dagster evaluates: yesterday at the new time
        if not flexpipe:
            assert backfilled[1:] == ("SUCCESS", None, 1) and len(instance.get_runs()) == 2  # the symptom
            return
        assert backfilled[1] == "SKIPPED" and backfilled[3] == 0 and len(instance.get_runs()) == 1
        assert backfilled[2].startswith("tick of 2026-11-30 14:00 UTC evaluated 11.0 h late (limit 600 s)")
        _scheduler_iteration(instance, monkeypatch, schedule("0 14 * * *"),
                             day + dt.timedelta(days=1, hours=14, seconds=20))
        assert _ticks(instance)[-1][:2] == (day + dt.timedelta(days=1, hours=14), "SUCCESS")
        assert len(instance.get_runs()) == 2  # the new cron's first tick runs, on time


# -- 6. one pipeline runtime per host ---------------------------------------------------------------------------
def test_runtime_ops_declare_the_pool_and_the_shipped_config_limits_it_to_one():
    from flexpipe_dag.jobs.batch import batch_inference
    from flexpipe_dag.jobs.gear_shift import gear_shift
    from flexpipe_dag.jobs.serve import serve_trace
    from flexpipe_dag.jobs.serve_frontdoor import serve_frontdoor

    assert {n.name: n.definition.pool for j in (serve_trace, serve_frontdoor, batch_inference) for n in j.nodes} == {
        "serve": PIPELINE_RUNTIME_POOL, "serve_http": PIPELINE_RUNTIME_POOL, "run_batch": PIPELINE_RUNTIME_POOL}
    assert [n.definition.pool for n in gear_shift.nodes] == [None]  # it asks the runtime holding the pool to shift
    shipped = REPO / "deploy" / "dagster.yaml"
    assert (REPO / "flexpipe_dag" / "data" / "dagster.yaml").read_text() == shipped.read_text()  # what demo copies
    pools = yaml.safe_load(shipped.read_text())["concurrency"]["pools"]
    assert pools == {"default_limit": 1}  # every pool, pipeline_runtime included, holds one op at a time


def test_the_shipped_instance_purges_old_sensor_ticks(tmp_path):
    """Two sensors tick every 30 s for as long as the daemon runs: Dagster kept their successful and failed ticks
    forever by default."""
    from dagster._core.definitions.run_request import InstigatorType
    from dagster._core.scheduler.instigation import TickStatus

    home = tmp_path / "dagster"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "deploy" / "dagster.yaml").read_text())
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_tick_retention_settings(InstigatorType.SENSOR) == {
            TickStatus.STARTED: -1, TickStatus.SKIPPED: 7, TickStatus.SUCCESS: 90, TickStatus.FAILURE: 30}
        assert set(instance.get_tick_retention_settings(InstigatorType.SCHEDULE).values()) == {90}


#: Where the pooled test op writes what it saw (set in the runs' environment).
SPANS_DIR_VAR = "FLEXPIPE_TEST_POOL_DIR"


@op(pool=PIPELINE_RUNTIME_POOL)
def hold_runtime(context) -> None:
    """Stands in for a runtime op: takes the host's runtime lock as ``serve`` and ``run_batch`` do, then
    holds it until the other run is seen waiting (on the Dagster pool or on the lock) or has finished."""
    out = Path(os.environ[SPANS_DIR_VAR])

    def waiting(line: str) -> None:
        context.log.info(line)
        (out / f"waiting-{context.run_id}").touch()

    with hold_runtime_lock(f"Dagster run {context.run_id[:8]} (hold_runtime)", waiting) as waited_s:
        start = time.time()
        other_waited = False
        deadline = start + 240.0  # generous: a loaded host can take long to start the other run; it ends when seen
        while not list(out.glob("done-*")) and time.time() < deadline:
            info = context.instance.event_log_storage.get_concurrency_info(PIPELINE_RUNTIME_POOL)
            # the other run's step on the pool: pending, or (Dagster's SQLite claim is not atomic) marked
            # assigned without a slot, which pending_step_count leaves out (seen in CI)
            on_pool = {s.run_id for s in info.pending_steps} - {context.run_id}
            # a step is pending for a moment while its claim is under way, then takes a slot freed meanwhile
            # without ever waiting: it waits once its run has logged that the pool blocked it
            blocked = [rid for rid in on_pool if any("blocked by limit for pool" in (e.message or "")
                                                     for e in context.instance.all_logs(rid))]
            on_lock = [p for p in out.glob("waiting-*") if p.name != f"waiting-{context.run_id}"]
            if blocked or on_lock:  # the other run's runtime step waits for this one
                other_waited = True
                break
            time.sleep(0.1)
        (out / f"done-{context.run_id}").write_text(json.dumps({"start": start, "end": time.time(),
                                                                "other_waited": other_waited,
                                                                "waited_s": waited_s}))


@job
def pooled_runtime_job():
    hold_runtime()


@pytest.mark.parametrize("pool_limit", [1, None], ids=["shipped-pool", "pool-lets-both-through"])
def test_two_queued_runtime_runs_never_overlap_and_the_second_waits(tmp_path, pool_limit):
    """With the shipped pool, and with a pool that lets both steps start (what Dagster's non-atomic SQLite
    slot claim amounts to when two runs race: seen in CI), the host lock keeps the runtimes apart."""
    home = tmp_path / "dagster"
    home.mkdir()
    shipped = yaml.safe_load((REPO / "deploy" / "dagster.yaml").read_text())
    if pool_limit is None:
        del shipped["concurrency"]["pools"]
    (home / "dagster.yaml").write_text(yaml.safe_dump(shipped))
    with DagsterInstance.from_config(str(home)) as instance:  # its storage created once, before the two runs race
        assert instance.event_log_storage.supports_global_concurrency_limits and instance.get_runs() == []
        slots = initialise_pools(instance)  # as `flexpipe demo` does
        assert slots == {"pipeline_runtime": pool_limit or 0, "device_probe": pool_limit or 0}
    env = {**os.environ, "DAGSTER_HOME": str(home), SPANS_DIR_VAR: str(tmp_path), "PYTHONPATH": str(REPO)}
    code = ("from dagster import DagsterInstance\n"
            "from tests.test_control_semantics_dagster import pooled_runtime_job\n"
            "with DagsterInstance.get() as instance:\n"
            "    assert pooled_runtime_job.execute_in_process(instance=instance).success\n")
    runs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [r.communicate(timeout=300)[0] for r in runs]
    assert [r.returncode for r in runs] == [0, 0], outputs  # both succeed: the second waited, it did not fail
    first, second = sorted((json.loads(p.read_text()) for p in tmp_path.glob("done-*")), key=lambda s: s["start"])
    assert first["end"] <= second["start"]  # never two runtimes at once
    assert first["other_waited"] and not second["other_waited"]  # the second run's step queued behind the first
    # it waited on the pool, or (when Dagster's non-atomic SQLite claim let both steps start) on the host lock
    blocked = [("Step blocked by limit for pool pipeline_runtime" in out) or
               ("waiting for the pipeline runtime on this host" in out) for out in outputs]
    assert sum(blocked) == 1, outputs
    if pool_limit is None:  # no pool to queue on: the lock alone made it wait, naming the first run
        assert sum("is held by Dagster run" in out for out in outputs) == 1, outputs
