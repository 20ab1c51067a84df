"""Control-loop semantics at production scale (issue #16, items 1-3): idempotent shift events, sensor
evaluations bounded in time over a week's backlog, and shifts only on a live serving run."""

from __future__ import annotations

import math
import time

import pytest
from dagster import DagsterInstance, RunRequest, SkipReason, build_sensor_context
from sqlalchemy import insert

from flexpipe_dag.control.config import ControllerConfig
from flexpipe_dag.control.controller import Controller
from flexpipe_dag.control.cursor import make_cursor, parse_cursor, read_gear_shift_cursor
from flexpipe_dag.control.service import (
    _migration_cost,
    candidate_gears_for,
    decision_key,
    evaluate_gear_shift,
    shift_run_key,
)
from flexpipe_dag.control.settings import ResolvedControlSettings
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.liveness import PipelineLiveness
from flexpipe_dag.core.metrics import MetricSample, StageSample
from flexpipe_dag.jobs.gear_shift import gear_shift, gear_shift_sensor
from flexpipe_dag.resources.control import ControlSettings
from flexpipe_dag.resources.store_resource import StoreResource
from flexpipe_dag.sql import models as m
from tests.support import EXAMPLES, BackgroundThread, enveloped_gear, wait_until

GEARS = [enveloped_gear("latency-1s", "latency", 0.0, 5.0, 1),
         enveloped_gear("throughput-2s", "throughput", 3.5, 40.0, 2)]
SEEDS = ResolvedControlSettings()


@pytest.fixture
def store_res(tmp_path):
    from flexpipe_dag.core.cluster import load_cluster_profile

    res = StoreResource(database_url=f"sqlite:///{tmp_path / 'fp.db'}")
    db = res.get_store()
    info = db.save_profile(load_cluster_profile(EXAMPLES / "seed_example.yaml"))
    db.save_gears(GEARS, info.id, db.save_model("SmolLM2-135M", "bf16", 30, {"layers": 30}))
    return res


def _sample(gear_id: str, t_s: float, rps: float, busy: float = 0.8) -> MetricSample:
    return MetricSample(t_s=t_s, gear_id=gear_id, source="live", rps=rps, completed=int(rps * 2),
                        tokens_per_s=rps * 100, queue_length=5, running=8, kv_used_fraction=0.3,
                        ttft_p99_ms=300.0, tpot_p99_ms=40.0, stages=(StageSample(0, busy, 1, 10, 100),))


def _samples(gear_id, rps_values, t0=0.0):
    return [_sample(gear_id, t0 + 2.0 * (i + 1), q) for i, q in enumerate(rps_values)]


def _tick(store_res, cursor=None):
    ctx = build_sensor_context(instance=DagsterInstance.ephemeral(), cursor=cursor,
                               resources={"store": store_res, "control": ControlSettings()})
    return gear_shift_sensor(ctx), ctx.cursor


def _live_pipeline(db, run_key, outcome="done"):
    """The serving run's side of the protocol: take the first request addressed to ``run_key``, report ``outcome``."""
    def serve():
        ev = wait_until(lambda: db.pending_shift_requests(run_key), 20, "a shift request", interval_s=0.1)[0]
        assert db.claim_shift_request(ev.id, run_key)
        db.update_shift_event(ev.id, outcome, {"outcome": "switched"})

    thread = BackgroundThread(serve, name="live-pipeline")
    thread.start()
    return thread


# -- 1. idempotent shift events ---------------------------------------------------------------------
def test_reexecuting_a_done_shift_run_is_a_no_op_that_says_so(store_res):
    db = store_res.get_store()
    db.write_samples("serve-1", _samples("latency-1s", [12.0] * 6))  # far above latency-1s's 5 req/s
    request, _ = _tick(store_res)
    assert isinstance(request, RunRequest)
    run_config = request.run_config
    server = _live_pipeline(db, "serve-1")
    first = gear_shift.execute_in_process(run_config=run_config, resources={"store": store_res})
    server.join_or_fail(30)
    event_id = run_config["ops"]["apply_gear_shift"]["config"]["event_id"]
    done = db.get_shift_event(event_id)
    assert first.success and done.status == "done" and done.details["dagster_run_id"] == first.run_id
    # the run executed again (a re-execution from the UI, a retry): the event is not requested again
    again = gear_shift.execute_in_process(run_config=run_config, resources={"store": store_res})
    assert again.success
    out = again.output_for_node("apply_gear_shift")
    assert out["noop"] is True and out["status"] == "done"
    assert out["note"] == (f"shift event {event_id} is already done (requested by run {first.run_id}): nothing to do, "
                           "the event is left as it is")
    after = db.get_shift_event(event_id)
    assert (after.status, after.details, after.expires_at) == (done.status, done.details, done.expires_at)
    assert db.pending_shift_requests() == []


def test_a_shift_run_never_moves_an_event_backwards(store_res):
    db = store_res.get_store()
    event_id = db.record_shift_event("shift", "decided", "r", from_gear_key="latency-1s", to_gear_key="throughput-2s",
                                     run_key="serve-1", decision_key="k1")
    moved, ev = db.request_shift(event_id, "serve-1", 60.0, {"dagster_run_id": "run-a"})
    assert moved and ev.status == "requested" and ev.run_key == "serve-1"
    # a second run asking again changes nothing, not even the run id stored
    moved, ev = db.request_shift(event_id, "serve-1", 60.0, {"dagster_run_id": "run-b"})
    assert not moved and ev.details["dagster_run_id"] == "run-a"
    assert not db.claim_shift_request(event_id, "serve-2")  # addressed to serve-1 only
    assert db.claim_shift_request(event_id, "serve-1") and not db.claim_shift_request(event_id, "serve-1")
    assert db.get_shift_event(event_id).status == "applying"
    assert db.expire_shift_requests() == []  # taken: it cannot expire


def test_a_declined_event_is_not_a_shift_to_apply(store_res):
    db = store_res.get_store()
    event_id = db.record_shift_event("hold", "declined", "declined: inside dwell", run_key="serve-1")
    result = gear_shift.execute_in_process(
        run_config={"ops": {"apply_gear_shift": {"config": {"to_gear_id": "throughput-2s", "event_id": event_id}}}},
        resources={"store": store_res}, raise_on_error=False)
    assert not result.success and db.get_shift_event(event_id).status == "declined"


def test_one_decision_is_one_event_row_whatever_the_retries(store_res):
    db = store_res.get_store()
    db.write_samples("serve-1", _samples("latency-1s", [2.0, 2.0]))
    ev0 = evaluate_gear_shift(db, None, SEEDS)
    db.write_samples("serve-1", _samples("latency-1s", [12.0] * 6, t0=4.0))
    ev1 = evaluate_gear_shift(db, ev0.cursor, SEEDS)
    retry = evaluate_gear_shift(db, ev0.cursor, SEEDS)  # the tick evaluated again with its old cursor
    assert ev1.run_key == retry.run_key == f"{shift_run_key(ev1.decision)}@serve-1"
    assert ev1.event_id == retry.event_id
    shifts = [e for e in db.shift_events() if e.action == "shift"]
    assert len(shifts) == 1 and shifts[0].decision_key == ev1.run_key and shifts[0].run_key == "serve-1"
    # declined decisions too: the pipeline serves throughput-2s, the load falls inside the dwell
    db.write_samples("serve-1", _samples("throughput-2s", [0.5] * 8, t0=20.0))
    d1 = evaluate_gear_shift(db, ev1.cursor, SEEDS)
    d2 = evaluate_gear_shift(db, ev1.cursor, SEEDS)
    assert d1.decision.declined and d1.event_id == d2.event_id and d1.run_key is None
    assert [e.status for e in db.shift_events()] == ["decided", "declined"]
    assert db.get_shift_event(d1.event_id).decision_key == (
        f"declined:{d1.decision.trigger}:throughput-2s->{d1.decision.to_gear_id}@t{d1.decision.t_s:.1f}@serve-1")


@pytest.mark.parametrize(("repeat_s", "stored_t_s"), [(600.0, [36.0]), (200.0, [36.0, 244.0, 452.0]),
                                                      (0.0, [36.0 + 16.0 * i for i in range(37)])])
def test_a_decline_that_keeps_firing_is_stored_once_per_decline_repeat_s(store_res, repeat_s, stored_t_s):
    """Inside the dwell the same decline comes at every evaluation; it is stored again only after decline_repeat_s
    (the samples' clock), and every evaluation still returns the decision."""
    db = store_res.get_store()
    settings = ResolvedControlSettings(controller=ControllerConfig(decline_repeat_s=repeat_s))
    db.write_samples("serve-1", _samples("latency-1s", [2.0, 2.0]))
    ev = evaluate_gear_shift(db, None, settings)
    db.write_samples("serve-1", _samples("latency-1s", [12.0] * 6, t0=4.0))
    ev = evaluate_gear_shift(db, ev.cursor, settings)
    assert ev.decision.action == "shift"
    seen = []
    for i in range(37):  # t_s 36 .. 612, all inside the 1800-s dwell
        db.write_samples("serve-1", _samples("throughput-2s", [0.5] * 8, t0=20.0 + 16.0 * i))
        ev = evaluate_gear_shift(db, ev.cursor, settings)
        assert ev.decision.declined and ev.decision.reason_kind == "dwell"
        seen.append(ev.decision.t_s)
        if ev.event_id is None:
            assert ev.note.startswith("alike the decline stored at t_s=") and ev.note.endswith(
                f"not stored again within decline_repeat_s {repeat_s:g} s")
    assert seen == [36.0 + 16.0 * i for i in range(37)]
    declined = [e for e in db.shift_events() if e.status == "declined"]
    assert [e.details["t_s"] for e in declined] == stored_t_s


def test_decision_keys_name_the_run_the_samples_came_from():
    d = Controller().decide(None, _samples("latency-1s", [12.0] * 6), GEARS)[1]
    assert d.action == "shift"
    assert decision_key(d, "serve-7") == "gear-shift:latency-1s->throughput-2s@t12.0@serve-7"
    assert decision_key(d, "serve-7", "serve-7:") == "serve-7:gear-shift:latency-1s->throughput-2s@t12.0"


def test_record_shift_event_with_a_stored_key_writes_nothing(store_res):
    db = store_res.get_store()
    first = db.record_shift_event("shift", "decided", "first", to_gear_key="g", decision_key="gear-shift:a->g@t1.0")
    second = db.record_shift_event("shift", "decided", "second", to_gear_key="g", decision_key="gear-shift:a->g@t1.0")
    other = db.record_shift_event("shift", "decided", "other", to_gear_key="g")  # no key: always a new row
    assert first == second != other
    assert [e.reason for e in db.shift_events()] == ["first", "other"]
    with pytest.raises(InputError, match="shift_events: decision_key: expected a string of at most 200"):
        db.record_shift_event("shift", "decided", "r", decision_key="k" * 201)


# -- 2. evaluations bounded in time -------------------------------------------------------------------
WEEK_SAMPLES = 7 * 86400 // 2  # 302,400 samples, one every 2 s


def _week() -> list[MetricSample]:
    """A week of 2-s samples: the daily tide inside latency-1s's envelope, a day on throughput-2s mid-week, and a
    rise far above latency-1s's envelope in the last 20 s."""
    out = []
    for i in range(WEEK_SAMPLES):
        t_s = 2.0 * (i + 1)
        day = int(t_s // 86400)
        gear = "throughput-2s" if day == 3 else "latency-1s"
        rps = 12.0 if i >= WEEK_SAMPLES - 10 else (20.0 if day == 3 else 2.5 + 1.5 * math.sin(t_s * 2 * math.pi / 86400))
        out.append(_sample(gear, t_s, round(rps, 6), busy=0.5 + 0.3 * ((i // 7) % 2)))
    return out


def _bulk_write(db, run_key: str, samples: list[MetricSample]) -> None:
    """What ``write_samples`` stores, inserted in bulk (one pipeline row and one stage row per sample)."""
    heads, stages = [], []
    for i, smp in enumerate(samples):
        head_id = 2 * i + 1
        heads.append(dict(id=head_id, run_key=run_key, gear_key=smp.gear_id, source=smp.source, t_s=smp.t_s,
                          scope="pipeline", rps=smp.rps, completed=smp.completed, tokens_per_s=smp.tokens_per_s,
                          queue_length=smp.queue_length, running=smp.running, kv_used_fraction=smp.kv_used_fraction,
                          ttft_p99_ms=smp.ttft_p99_ms, tpot_p99_ms=smp.tpot_p99_ms))
        st = smp.stages[0]
        stages.append(dict(id=head_id + 1, run_key=run_key, gear_key=smp.gear_id, source=smp.source, t_s=smp.t_s,
                           scope="stage", parent_id=head_id, stage_index=st.stage_index, busy_fraction=st.busy_fraction,
                           queue_length=st.queue_length, kv_blocks_used=st.kv_blocks_used,
                           kv_blocks_total=st.kv_blocks_total))
    with db.engine.begin() as conn:
        conn.execute(insert(m.MetricSampleRow), heads)
        conn.execute(insert(m.MetricSampleRow), stages)


def test_a_week_of_samples_is_read_in_bounded_evaluations_with_the_decision_of_one_pass(store_res):
    db = store_res.get_store()
    week = _week()
    _bulk_write(db, "serve-1", week)
    assert db.read_samples(run_key="serve-1", after_id=2 * 1000, limit=1)[0][1] == week[1000]  # stored as made
    cursor, evaluations = None, []
    while True:
        start = time.perf_counter()
        ev = evaluate_gear_shift(db, cursor, SEEDS)
        evaluations.append((time.perf_counter() - start, ev))
        cursor = ev.cursor
        if not ev.backlog:
            break
        assert ev.run_key is None and ev.event_id is None and not db.shift_events()  # no decision on a backlog
        assert ev.decision.action == "hold" and ev.decision.reason_kind == "backlog"
        assert "reading a backlog of metric samples of run serve-1" in ev.summary
    # bounded: the 2-s budget plus the page in hand (generous: a loaded 2-core host read one page in over 3 s)
    slowest_s = max(s for s, _ in evaluations)
    assert slowest_s < 15.0, [round(s, 2) for s, _ in evaluations]
    assert len(evaluations) > 1 and sum(e.samples_read for _, e in evaluations) == WEEK_SAMPLES
    # one pass of the controller over the whole week, in memory
    gears = candidate_gears_for(db, ["latency-1s", "throughput-2s"])
    ref_state, ref_decision = Controller(SEEDS.controller).decide(
        None, week, gears, unhealthy=db.unhealthy_gear_keys(), migration_cost_s=_migration_cost(db, gears))
    final = evaluations[-1][1]
    assert ref_decision.action == "shift" and ref_decision.to_gear_id == "throughput-2s"
    assert final.decision == ref_decision
    assert parse_cursor(final.cursor)[0] == ref_state and parse_cursor(final.cursor)[1] == 2 * WEEK_SAMPLES - 1
    (event,) = db.shift_events()
    assert event.status == "decided" and event.reason == ref_decision.reason and event.decision_key == final.run_key


def test_backlog_pages_through_observe_equal_one_decide_with_a_raised_threshold():
    """The dwell threshold raised in an early page still counts at the decision, as in one pass."""
    ctl = Controller(ControllerConfig())
    state, first = ctl.decide(None, _samples("latency-1s", [12.0] * 6), GEARS)
    assert first.action == "shift"
    later = (_samples("throughput-2s", [0.5] * 6, t0=20.0) + _samples("throughput-2s", [5.0] * 2, t0=32.0)
             + _samples("throughput-2s", [0.5] * 3, t0=36.0))
    ref_state, ref = ctl.decide(state, later, GEARS)
    st, raised = state, None
    for page in (later[:4], later[4:7], later[7:9]):
        st, raised = ctl.observe(st, page, GEARS, raised_by=raised)
    assert raised == "rps_below_envelope"
    paged_state, paged = ctl.decide(st, later[9:], GEARS, raised_by=raised)
    assert (paged_state, paged) == (ref_state, ref) and ref.declined and "threshold raised" in ref.reason
    # the cursor keeps the raised trigger between evaluations
    cursor = make_cursor(st, 9, "serve-1", raised)
    assert read_gear_shift_cursor(cursor) == (st, 9, "serve-1", "rps_below_envelope", None)
    with pytest.raises(InputError, match="gear_shift_sensor cursor: raised_by: 'x' is not a trigger"):
        read_gear_shift_cursor(cursor.replace("rps_below_envelope", "x"))


# -- 3. only a live pipeline shifts -----------------------------------------------------------------
def test_a_finished_batch_jobs_samples_never_trigger_a_shift(store_res):
    db = store_res.get_store()
    db.heartbeat_pipeline_run("batch-run", "batch", "latency-1s")
    db.write_samples("batch-run", _samples("latency-1s", [12.0] * 6))
    result, _ = _tick(store_res)
    assert isinstance(result, SkipReason)
    assert result.skip_message == ("no live serving run writes metric samples (run batch-run is a batch job: its "
                                   "samples never trigger a shift)")
    db.end_pipeline_run("batch-run")
    result, _ = _tick(store_res)
    assert isinstance(result, SkipReason) and "batch-run is a batch job" in result.skip_message
    assert not db.shift_events()


def test_an_ended_serving_runs_samples_never_trigger_a_shift(store_res):
    db = store_res.get_store()
    db.heartbeat_pipeline_run("serve-1", "serve", "latency-1s")
    db.write_samples("serve-1", _samples("latency-1s", [12.0] * 6))
    db.end_pipeline_run("serve-1")
    db.heartbeat_pipeline_run("serve-1", "serve", "latency-1s")  # a late heartbeat does not bring it back
    result, _ = _tick(store_res)
    assert isinstance(result, SkipReason) and result.skip_message.startswith(
        "no live serving run writes metric samples (run serve-1 ended ")
    assert result.skip_message.endswith(" s ago: its samples never trigger a shift)")
    # the serve loop naming its own (ended) run gets the same answer as a decision that says why
    ev = evaluate_gear_shift(db, None, SEEDS, run_key="serve-1")
    assert ev.decision.action == "hold" and ev.run_key is None and ev.decision.reason_kind == "not_live" and "ended" in ev.decision.reason
    assert not db.shift_events()


def test_stale_samples_hold_and_say_why(store_res):
    db = store_res.get_store()
    db.write_samples("serve-1", _samples("latency-1s", [12.0] * 6))
    later = time.time() + 300.0  # five minutes later, nothing new written
    ev = evaluate_gear_shift(db, None, SEEDS, epoch_s=later)
    assert ev.decision.action == "hold" and ev.run_key is None and not db.shift_events()
    assert ev.decision.reason_kind == "not_live"
    assert ev.decision.reason.startswith("hold: samples of run serve-1 are stale: the newest was written 30")
    assert ev.decision.reason.endswith(" s ago, over the 120 s freshness bound (controller.sample_freshness_s)")
    assert parse_cursor(ev.cursor)[1] == 11  # consumed all the same: no decision on them later
    # within the bound the same samples shift
    fresh = evaluate_gear_shift(db, None, SEEDS)
    assert fresh.decision.action == "shift"


def test_a_silent_serving_run_holds():
    info = PipelineLiveness("serve-1", kind="serve", heartbeat_at_s=1000.0, newest_sample_id=3, newest_sample_t_s=6.0,
                            newest_sample_written_s=1100.0)
    assert info.why_not_live(1150.0, 120.0) == ("run serve-1 is silent: its last heartbeat was 150 s ago, over the "
                                                "120 s freshness bound (controller.sample_freshness_s)")
    assert info.why_not_live(1110.0, 120.0) is None
    assert PipelineLiveness("x").why_not_live(0.0, 120.0) == "run x has written no metric sample"


def test_sensor_follows_the_live_serving_run_not_the_newest_writer(store_res):
    db = store_res.get_store()
    db.heartbeat_pipeline_run("serve-1", "serve", "latency-1s")
    db.write_samples("serve-1", _samples("latency-1s", [12.0] * 6))
    db.heartbeat_pipeline_run("batch-run", "batch", "latency-1s")
    db.write_samples("batch-run", _samples("latency-1s", [1.0] * 3))  # newer, but a batch job's
    assert db.latest_sample_run_key() == "batch-run" and db.latest_shiftable_run_key() == "serve-1"
    result, _ = _tick(store_res)
    assert isinstance(result, RunRequest) and result.run_key.endswith("@serve-1")


def test_a_request_for_an_earlier_run_expires_and_the_next_run_never_applies_it(store_res):
    db = store_res.get_store()
    db.write_samples("serve-old", _samples("latency-1s", [12.0] * 6))
    ev = evaluate_gear_shift(db, None, SEEDS)
    moved, stored = db.request_shift(ev.event_id, "serve-old", 0.5)
    assert moved and stored.run_key == "serve-old"
    db.end_pipeline_run("serve-old")
    db.heartbeat_pipeline_run("serve-new", "serve", "latency-1s")
    assert db.pending_shift_requests("serve-new") == [] and not db.claim_shift_request(ev.event_id, "serve-new")
    time.sleep(0.6)
    assert db.pending_shift_requests("serve-old") == []  # past its deadline: not handed out any more
    assert not db.claim_shift_request(ev.event_id, "serve-old")
    assert db.expire_shift_requests() == [ev.event_id]
    expired = db.get_shift_event(ev.event_id)
    assert expired.status == "expired" and expired.details["error"].startswith(
        "no live serving run took the shift by its deadline ")
    assert expired.details["error"].endswith("(addressed to run serve-old)")


def test_a_stale_request_expires_its_run_and_a_re_execution_is_a_no_op(store_res):
    db = store_res.get_store()
    db.write_samples("serve-1", _samples("latency-1s", [12.0] * 6))
    request, _ = _tick(store_res)
    config = request.run_config["ops"]["apply_gear_shift"]["config"]
    run_config = {"ops": {"apply_gear_shift": {"config": {**config, "pickup_deadline_s": 0.5, "timeout_s": 10}}}}
    first = gear_shift.execute_in_process(run_config=run_config, resources={"store": store_res}, raise_on_error=False)
    assert not first.success
    ev = db.get_shift_event(config["event_id"])
    assert ev.status == "expired" and ev.run_key == "serve-1" and ev.details["dagster_run_id"] == first.run_id
    again = gear_shift.execute_in_process(run_config=run_config, resources={"store": store_res})
    assert again.success and again.output_for_node("apply_gear_shift")["noop"] is True
    assert db.get_shift_event(config["event_id"]).details["dagster_run_id"] == first.run_id


# -- trial findings of issue #16's work ------------------------------------------------------------------------
def _serve_loop(db, serving_gear_id, inline_control=False):
    """A serve loop on ``serving_gear_id`` whose executor only records the shifts it is asked for."""
    from types import SimpleNamespace

    from flexpipe_dag.serving.serve import ServeSettings, TraceServer

    applied: list[str] = []

    def shift(gear):
        applied.append(gear.gear_id)
        return SimpleNamespace(status="done", reason="switched", timings_s={"total": 0.0}, mode="test",
                               requests_moved=0, unhealthy_gear_id=None, failure_kind=None,
                               to_details=lambda: {"mode": "test"})

    router = SimpleNamespace(active=SimpleNamespace(gear=SimpleNamespace(gear_id=serving_gear_id)))
    server = TraceServer(db, SEEDS, router, SimpleNamespace(shift=shift), GEARS,
                         ServeSettings(run_key="serve-1", online_job_key="serve-1-online",
                                       inline_control=inline_control), log=lambda line: None)
    return server, applied


def test_the_sensor_leaves_a_serve_loop_with_inline_control_alone(store_res):
    """Finding 1: the serve loop and the sensor both decided on one run: two events, two shifts."""
    db = store_res.get_store()
    db.heartbeat_pipeline_run("serve-1", "serve", "latency-1s", inline_control=True)
    db.write_samples("serve-1", _samples("latency-1s", [12.0] * 6))
    inline = evaluate_gear_shift(db, None, SEEDS, run_key_prefix="serve-1:", run_key="serve-1")
    assert inline.decision.action == "shift" and inline.run_key == "serve-1:gear-shift:latency-1s->throughput-2s@t12.0"
    assert db.latest_shiftable_run_key() is None and db.pipeline_liveness("serve-1").inline_control is True
    result, _ = _tick(store_res)
    assert isinstance(result, SkipReason)
    assert result.skip_message == ("no serving run for this sensor to follow: run serve-1 decides its own shifts (a "
                                   "serve loop with inline control), so the sensor leaves it alone")
    assert [e.decision_key for e in db.shift_events()] == [inline.run_key]  # one decision, one event
    # a loop that applies gear_shift runs instead (inline control off) is followed again
    db.heartbeat_pipeline_run("serve-1", "serve", "latency-1s", inline_control=False)
    assert db.latest_shiftable_run_key() == "serve-1"


def test_the_serve_loop_refuses_a_stale_or_same_gear_request(store_res):
    """Finding 1: a request whose target already serves, or decided on another gear, is failed, never applied."""
    db = store_res.get_store()
    db.write_samples("serve-1", _samples("latency-1s", [12.0] * 6))
    same = db.record_shift_event("shift", "decided", "r", from_gear_key="latency-1s", to_gear_key="throughput-2s",
                                 run_key="serve-1", decision_key="k-same")
    db.request_shift(same, "serve-1", 60)
    server, applied = _serve_loop(db, "throughput-2s")
    server._control_step()
    ev = db.get_shift_event(same)
    assert (ev.status, ev.details["error"]) == ("failed", "stale: throughput-2s is already serving")
    other = db.record_shift_event("shift", "decided", "r", from_gear_key="latency-1s", to_gear_key="latency-1s",
                                  run_key="serve-1", decision_key="k-other")
    db.request_shift(other, "serve-1", 60)
    server._control_step()
    ev = db.get_shift_event(other)
    assert (ev.status, ev.details["error"]) == ("failed", "stale: decided on latency-1s, but throughput-2s is "
                                                          "serving now")
    assert applied == [] and server._shift_thread is None
    assert [s["status"] for s in server.report.shifts] == ["failed", "failed"]


def test_the_executor_never_migrates_to_the_gear_already_serving():
    from types import SimpleNamespace

    from flexpipe_dag.shift.executor import GearExecutor

    lane = SimpleNamespace(gear=GEARS[1], alive=True)
    router = SimpleNamespace(active=lane, ledger=SimpleNamespace(moved=0), failures=[])
    out = GearExecutor(router).shift(GEARS[1])
    assert (out.status, out.reason, out.failed_step) == ("failed", "stale: throughput-2s is already serving", "plan")


def test_a_cursor_ahead_of_the_store_starts_afresh(store_res):
    """Finding 2: a cursor whose last_sample_id is past the store's newest (a reset store) went silent."""
    db = store_res.get_store()
    db.write_samples("serve-1", _samples("latency-1s", [12.0] * 6))
    # another run followed before: its position means nothing for serve-1
    ev = evaluate_gear_shift(db, '{"controller": null, "last_sample_id": 5000, "run_key": "old-run"}', SEEDS)
    assert ev.decision.action == "shift" and ev.samples_read == 6 and parse_cursor(ev.cursor)[1:] == (11, "serve-1")
    assert ev.note is None
    # the same run, in a store that was reset under the Dagster instance
    ev = evaluate_gear_shift(db, '{"controller": null, "last_sample_id": 5000, "run_key": "serve-1"}', SEEDS)
    assert ev.decision.action == "shift" and ev.samples_read == 6
    assert ev.note == ("the cursor's last_sample_id 5000 is past run serve-1's newest sample (11): the store was "
                       "reset; reading the run afresh")


def test_a_tide_cursor_ahead_of_the_store_starts_afresh(store_res):
    from flexpipe_dag.control.cursor import TideCursor
    from flexpipe_dag.control.service import evaluate_tide
    from flexpipe_dag.control.tide import TideConfig

    db = store_res.get_store()
    db.write_samples("serve-1", _samples("latency-1s", [2.0] * 3))
    assert db.newest_sample_id() == 5
    ev = evaluate_tide(db, '{"last_sample_id": 99999999}', TideConfig())
    cursor = TideCursor.parse(ev.cursor)
    assert ev.decision is not None and cursor.last_sample_id == 5 and cursor.ema_rps == 2.0


@pytest.mark.parametrize(("cursor", "message"), [
    ('{"last_sample_id": "abc"}', "gear_shift_sensor cursor: last_sample_id: cannot parse: Input should be a valid "
                                  "integer"),
    ('{"last_sample_id": 1e300}', "gear_shift_sensor cursor: last_sample_id: cannot parse: Input should be a valid "
                                  "integer"),
    ('{"last_sample_id": true}', "gear_shift_sensor cursor: last_sample_id: cannot parse: Input should be a valid "
                                 "integer"),
    ('{"last_sample_id": -1}', "gear_shift_sensor cursor: last_sample_id: cannot parse: Input should be greater "
                               "than or equal to 0"),
    ('{"last_decline": [1]}', "gear_shift_sensor cursor: last_decline.0: cannot parse: Input should be a valid string"),
    ('{"last_decline": ["a", NaN]}', "gear_shift_sensor cursor: last_decline.1: cannot parse: Input should be a "
                                     "finite number"),
    ('{"controller": {"x": 1}}', "gear_shift_sensor cursor: controller: cannot parse: Input should be a valid string"),
    ("[1]", "gear_shift_sensor cursor: cannot parse: Input should be an object"),
    ("[" * 100_000, "gear_shift_sensor cursor: cannot parse: Invalid JSON: recursion limit exceeded at line 1 column "
                    "202"),
])
def test_a_bad_gear_shift_cursor_is_one_input_error_naming_it(cursor, message):
    """Findings 2 and 10: a wrong type silenced the sensor for good or escaped as IndexError, RecursionError ..."""
    with pytest.raises(InputError) as err:
        read_gear_shift_cursor(cursor)
    assert str(err.value) == message


@pytest.mark.parametrize(("cursor", "message"), [
    ('{"gate": {"count": -1}}', "tide_sensor cursor: gate.count: Input should be greater than or equal to 0"),
    ('{"last_sample_id": true}', "tide_sensor cursor: last_sample_id: Input should be a valid integer"),
    ('{"last_sample_id": "7"}', "tide_sensor cursor: last_sample_id: Input should be a valid integer"),
])
def test_a_bad_tide_cursor_is_one_input_error_naming_it(cursor, message):
    from flexpipe_dag.control.cursor import TideCursor

    with pytest.raises(InputError) as err:
        TideCursor.parse(cursor)
    assert str(err.value) == message


def test_decision_keys_of_200_character_gear_ids_stay_within_200_characters(tmp_path):
    """Finding 4: a decision key over 200 characters crashed every sensor tick."""
    import hashlib

    from flexpipe_dag.control.service import bounded_key
    from flexpipe_dag.core.cluster import load_cluster_profile

    slow, fast = "l" * 199 + "1", "t" * 199 + "2"
    res = StoreResource(database_url=f"sqlite:///{tmp_path / 'fp.db'}")
    db = res.get_store()
    info = db.save_profile(load_cluster_profile(EXAMPLES / "seed_example.yaml"))
    db.save_gears([enveloped_gear(slow, "latency", 0.0, 5.0, 1), enveloped_gear(fast, "throughput", 3.5, 40.0, 2)],
                  info.id, db.save_model("SmolLM2-135M", "bf16", 30, {"layers": 30}))
    db.write_samples("serve-1", _samples(slow, [12.0] * 6))
    full = f"gear-shift:{slow}->{fast}@t12.0@serve-1"
    key = f"{full[:183]}#{hashlib.sha256(full.encode()).hexdigest()[:16]}"
    first = evaluate_gear_shift(db, None, SEEDS)
    assert first.decision.action == "shift" and first.run_key == key and len(key) == 200
    again = evaluate_gear_shift(db, None, SEEDS)  # a retried tick: the same key, the same row
    assert again.event_id == first.event_id and [e.decision_key for e in db.shift_events()] == [key]
    assert bounded_key("short") == "short" and bounded_key("x" * 200) == "x" * 200


def _shift_by_hand(store_res, **config):
    result = gear_shift.execute_in_process(run_config={"ops": {"apply_gear_shift": {"config": config}}},
                                           resources={"store": store_res}, raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    return failure.step_failure_data.error.message.strip()


def test_a_gear_shift_run_checks_its_config_before_storing_anything(store_res):
    """Finding 9: bad configs were accepted, stored a request that expired, or failed naming internal fields."""
    db = store_res.get_store()
    db.heartbeat_pipeline_run("serve-1", "serve", "latency-1s")
    db.write_samples("serve-1", _samples("latency-1s", [1.0] * 3))
    assert _shift_by_hand(store_res, to_gear_id="throughput-2s", event_id=999).endswith(
        "gear_shift config event_id 999: no such shift event is stored (0 = record a new one, a shift by hand)")
    assert _shift_by_hand(store_res, to_gear_id="no-such-gear").endswith(
        "gear_shift config to_gear_id 'no-such-gear': not a stored gear (name one of the gear ids `flexpipe plan` "
        "stored)")
    assert _shift_by_hand(store_res, to_gear_id="throughput-2s", run_key="no-such-run").endswith(
        "gear_shift config run_key 'no-such-run': not a live serving run (run no-such-run has written no metric "
        "sample)")
    db.heartbeat_pipeline_run("batch-1", "batch", "latency-1s")
    assert _shift_by_hand(store_res, to_gear_id="throughput-2s", run_key="batch-1").endswith(
        "gear_shift config run_key 'batch-1': not a live serving run (run batch-1 is a batch job: its samples never "
        "trigger a shift)")
    db.heartbeat_pipeline_run("serve-2", "serve", "latency-1s")  # a second server on the store: name one
    db.write_samples("serve-2", _samples("latency-1s", [1.0] * 3))
    assert _shift_by_hand(store_res, to_gear_id="throughput-2s").endswith(
        "several serving runs are live (serve-2, serve-1): name the one to shift with run_key")
    for bad in ({"pickup_deadline_s": math.inf}, {"timeout_s": math.nan}, {"timeout_s": 0.0},
                {"pickup_deadline_s": 86401.0}):
        with pytest.raises(Exception, match="pickup_deadline_s|timeout_s"):
            gear_shift.execute_in_process(run_config={"ops": {"apply_gear_shift": {"config": {
                "to_gear_id": "throughput-2s", **bad}}}}, resources={"store": store_res})
    assert db.shift_events() == []  # nothing stored by a refused config


def test_a_shift_by_hand_records_the_live_gear(store_res):
    db = store_res.get_store()
    db.heartbeat_pipeline_run("serve-1", "serve", "latency-1s")
    db.write_samples("serve-1", _samples("latency-1s", [1.0] * 3))
    message = _shift_by_hand(store_res, to_gear_id="throughput-2s", timeout_s=1.0, pickup_deadline_s=60.0)
    assert message.endswith("shift event 1: still requested after 1 s (is a serve_trace run serving against this "
                            "store as run serve-1? only its serve loop applies shifts)")
    (ev,) = db.shift_events()
    assert (ev.from_gear_key, ev.to_gear_key, ev.run_key) == ("latency-1s", "throughput-2s", "serve-1")


def test_evaluation_page_and_budget_have_minimums():
    """Finding 12: a page of 1 sample with a 1-microsecond budget held "backlog" for good."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="evaluation_page_samples\n  Input should be greater than or equal to 100"):
        ControllerConfig(evaluation_page_samples=1)
    with pytest.raises(ValidationError, match="evaluation_budget_s\n  Input should be greater than or equal to 0.1"):
        ControllerConfig(evaluation_budget_s=1e-6)
    cfg = ControllerConfig(evaluation_page_samples=100, evaluation_budget_s=0.1)
    assert (cfg.evaluation_page_samples, cfg.evaluation_budget_s) == (100, 0.1)


def test_the_sensor_follows_each_live_serving_run_on_its_own(store_res):
    """Finding 11, then several servers on one store: two live runs alternating samples. Before, only the newest
    writer was followed (the skip named the other). Each run now has its own controller and decisions: the one
    over its gear's envelope shifts (the event addressed to it alone), the other declines; a run that ends leaves
    the cursor, and a run whose samples cannot be decided on does not stop the others."""
    from flexpipe_dag.control.cursor import read_fleet_shift_cursor

    db = store_res.get_store()
    for i in range(3):
        db.write_samples("serve-a", [_sample("latency-1s", 2.0 * (i + 1), 1.0)])
        db.write_samples("serve-b", [_sample("latency-1s", 2.0 * (i + 1), 1.0)])
    assert db.recent_shiftable_run_keys() == ["serve-b", "serve-a"]
    result, cursor = _tick(store_res)
    assert isinstance(result, SkipReason)
    assert result.skip_message.startswith("run serve-b: declined: latency_under ")
    assert "; run serve-a: declined: latency_under " in result.skip_message
    assert sorted(read_fleet_shift_cursor(cursor)) == ["serve-a", "serve-b"]
    # serve-a's load rises past latency-1s's 5 req/s; serve-b's stays low: one shift, for serve-a
    for i in range(3, 9):
        db.write_samples("serve-a", [_sample("latency-1s", 2.0 * (i + 1), 12.0)])
        db.write_samples("serve-b", [_sample("latency-1s", 2.0 * (i + 1), 1.0)])
    result, cursor = _tick(store_res, cursor)
    assert isinstance(result, RunRequest) and result.run_key.endswith("@serve-a")
    shifts = [e for e in db.shift_events() if e.action == "shift"]
    assert [(e.run_key, e.to_gear_key) for e in shifts] == [("serve-a", "throughput-2s")]
    again, _ = _tick(store_res, cursor)  # nothing new: no second request
    assert isinstance(again, SkipReason)
    # serve-a ends: it leaves the cursor; a run whose samples name a gear the store lacks is named, not followed
    db.heartbeat_pipeline_run("serve-a", "serve")
    db.end_pipeline_run("serve-a")
    assert db.recent_shiftable_run_keys() == ["serve-b"]
    db.write_samples("serve-c", [_sample("no-such-gear", 2.0, 1.0)])
    db.write_samples("serve-b", [_sample("latency-1s", 20.0, 1.0)])
    result, cursor = _tick(store_res, cursor)
    assert sorted(read_fleet_shift_cursor(cursor)) == ["serve-b", "serve-c"]
    assert isinstance(result, SkipReason) and "run serve-c: not evaluated: metric samples: gear_id" in result.skip_message
    assert "run serve-b: " in result.skip_message


def test_a_sensor_tick_fails_when_no_followed_run_can_be_evaluated(store_res):
    """With one run followed, its bad samples fail the tick (as before several runs were followed): the error shows in
    the UI instead of a quiet skip."""
    db = store_res.get_store()
    db.write_samples("serve-c", [_sample("no-such-gear", 2.0, 1.0)])
    with pytest.raises(InputError, match="no serving run could be evaluated: run serve-c: metric samples: gear_id"):
        _tick(store_res)
