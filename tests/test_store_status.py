"""Status, action and source columns of the store: the enums of flexpipe_dag.core.status.

Every value round-trips on SQLite and PostgreSQL, a value outside the enum is refused with the field
and the allowed values named and nothing written, and the column comments list every value.
"""

from __future__ import annotations

import inspect as pyinspect

import pytest
from sqlalchemy import func, inspect, select

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.metrics import MetricSample
from flexpipe_dag.core.status import (
    TERMINAL_SHIFT_STATUSES,
    HealthFailure,
    InferenceJobKind,
    InferenceJobStatus,
    PipelineRunKind,
    RequestResultStatus,
    SampleSource,
    ShiftEventAction,
    ShiftEventStatus,
    checked,
    column_comment,
)
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.store import downgrade, migrate

#: (model column, enum) for every column that holds an enum's values.
ENUM_COLUMNS = [
    (m.ShiftEvent.__table__.c.action, ShiftEventAction),
    (m.ShiftEvent.__table__.c.status, ShiftEventStatus),
    (m.InferenceJob.__table__.c.status, InferenceJobStatus),
    (m.InferenceJob.__table__.c.kind, InferenceJobKind),
    (m.RequestResult.__table__.c.status, RequestResultStatus),
    (m.HealthTag.__table__.c.failure, HealthFailure),
    (m.MetricSampleRow.__table__.c.source, SampleSource),
    (m.PipelineRun.__table__.c.kind, PipelineRunKind),
]


def _sample(source: str, t_s: float = 2.0) -> MetricSample:
    return MetricSample(t_s=t_s, gear_id="g", source=source, rps=1.0, completed=1, tokens_per_s=1.0,
                        queue_length=0, running=0, kv_used_fraction=0.0)


def _count(store, model) -> int:
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(model))


def _refused(enum, field: str):
    """``pytest.raises`` for a refused write naming ``field`` and every allowed value."""
    return pytest.raises(InputError, match=rf"{field}: 'bogus' is not a {enum.__name__}; expected one of "
                         + ", ".join(v.value for v in enum) + "$")


# -- every value round-trips ------------------------------------------------------------------------
def test_every_shift_action_and_status_round_trips(store):
    for action in ShiftEventAction:
        for status in ShiftEventStatus:
            ev = store.record_shift_event(action, status, f"{action}/{status}")
            got = store.get_shift_event(ev)
            assert (got.action, got.status) == (action.value, status.value)
            assert type(got.status) is str  # stored and read back as plain text
    ev = store.record_shift_event("shift", "decided", "then every status by update")
    for status in ShiftEventStatus:
        store.update_shift_event(ev, status)
        assert store.get_shift_event(ev).status == status
    store.update_shift_event(ev, ShiftEventStatus.REQUESTED)
    assert ev in [e.id for e in store.pending_shift_requests()]
    assert {e.status for e in store.pending_shift_requests()} == {"requested"}


def test_every_job_and_result_status_round_trips(store):
    job = store.get_or_create_job("j")
    assert store.job_status(job) == InferenceJobStatus.QUEUED
    for status in InferenceJobStatus:
        store.update_job(job, status=status)
        assert store.job_status(job) == status.value
        assert [j.id for j in store.jobs(status=status)] == [job]
    for status in RequestResultStatus:
        assert store.write_result(job, f"r-{status}", prompt_tokens=1, output_token_ids=[1], status=status)
    assert {r.request_key: r.status for r in store.results(job)} == {f"r-{s}": s.value for s in RequestResultStatus}
    assert store.done_request_keys(job) == {"r-done"}


def test_every_health_failure_and_sample_source_round_trips(store):
    for failure in HealthFailure:
        store.mark_unhealthy(f"g-{failure}", "lab", "m", failure, "why")
    assert {t.gear_key: t.failure for t in store.health_tags()} == {f"g-{f}": f.value for f in HealthFailure}
    store.write_samples("run", [_sample(src, t_s=2.0 * i) for i, src in enumerate(SampleSource, 1)])
    assert [s.source for _, s in store.read_samples("run")] == [src.value for src in SampleSource]


# -- a bad value is refused and nothing is written -------------------------------------------------
def test_bad_shift_action_or_status_writes_nothing(store):
    with _refused(ShiftEventAction, "shift_events: action"):
        store.record_shift_event("bogus", "decided", "r")
    with _refused(ShiftEventStatus, "shift_events: status"):
        store.record_shift_event("shift", "bogus", "r")
    assert _count(store, m.ShiftEvent) == 0
    ev = store.record_shift_event("shift", "decided", "r")
    with _refused(ShiftEventStatus, "shift_events: status"):
        store.update_shift_event(ev, "bogus", {"error": "x"})
    got = store.get_shift_event(ev)
    assert (got.status, got.details) == ("decided", {})


def test_bad_job_or_result_status_writes_nothing(store):
    with _refused(InferenceJobStatus, "inference_jobs: status"):
        store.update_job(store.get_or_create_job("j"), status="bogus", total_requests=7)
    (job,) = store.jobs()
    assert (job.status, job.total_requests) == ("queued", 0)  # not even the valid field of the call
    with _refused(RequestResultStatus, "request_results: status"):
        store.write_result(job.id, "r1", prompt_tokens=1, output_token_ids=[1], status="bogus")
    assert store.results(job.id) == []


def test_bad_health_failure_or_sample_source_writes_nothing(store):
    with _refused(HealthFailure, "health_tags: failure"):
        store.mark_unhealthy("g", "lab", "m", "bogus", "why")
    assert store.health_tags(include_cleared=True) == []
    with _refused(SampleSource, "metric_samples: source"):
        store.write_samples("run", [_sample("sim"), _sample("bogus", t_s=4.0)])  # the second of a batch
    assert _count(store, m.MetricSampleRow) == 0


def test_checked_returns_the_member_and_refuses_non_strings():
    assert checked(ShiftEventStatus, "rolled_back", "t", "f") is ShiftEventStatus.ROLLED_BACK
    with pytest.raises(InputError, match="t: f: None is not a SampleSource"):
        checked(SampleSource, None, "t", "f")


# -- column comments name every value --------------------------------------------------------------
@pytest.mark.parametrize(("column", "enum"), ENUM_COLUMNS, ids=lambda x: getattr(x, "name", None) or str(x))
def test_model_comments_name_every_value_and_every_value_fits(column, enum):
    assert column.comment == column_comment(enum)
    assert column.comment.split(" | ") == [v.value for v in enum]
    assert max(len(v.value) for v in enum) <= column.type.length


def test_migrated_comments_name_every_value(engine):
    """PostgreSQL keeps the comments (SQLite has none); 0006 sets them and gives the old ones back."""
    migrate(engine)
    if not engine.dialect.supports_comments:
        pytest.skip(f"{engine.dialect.name} keeps no column comments")

    def comments():
        insp = inspect(engine)
        tables = set(insp.get_table_names())  # a downgrade drops the tables later revisions made
        return {(c.table.name, c.name): next(col["comment"] for col in insp.get_columns(c.table.name)
                                             if col["name"] == c.name) for c, _ in ENUM_COLUMNS if c.table.name in tables}

    assert comments() == {(c.table.name, c.name): column_comment(enum) for c, enum in ENUM_COLUMNS}
    downgrade(engine, "0005")
    assert comments()[("shift_events", "status")] == "decided | running | done | rolled_back | failed | declined"
    migrate(engine)
    assert comments()[("metric_samples", "source")] == "sim | live"


# -- callers -----------------------------------------------------------------------------------------
def test_terminal_shift_statuses_come_from_the_enum():
    from flexpipe_dag.jobs.gear_shift import TERMINAL_SHIFT_STATUSES as job_terminal

    assert job_terminal is TERMINAL_SHIFT_STATUSES
    assert set(job_terminal) == {ShiftEventStatus.DONE, ShiftEventStatus.ROLLED_BACK, ShiftEventStatus.FAILED,
                                 ShiftEventStatus.EXPIRED}
    assert "rolled_back" in job_terminal and "requested" not in job_terminal  # plain strings compare equal


def test_store_facade_keeps_its_public_methods():
    """The split into concern modules kept every public method of Store, and no new one appeared."""
    from flexpipe_dag.sql.store import Store

    public = {n for n, _ in pyinspect.getmembers(Store, callable) if not n.startswith("_")}
    assert public == {
        "from_url", "session",
        "save_profile", "list_profile_versions", "load_profile", "latest_profile",
        "save_model", "model_ids", "save_gears", "load_gears", "load_gear",
        "mark_unhealthy", "unhealthy_gear_keys", "health_tags", "clear_health",
        "write_samples", "prune_samples", "latest_sample_run_key", "newest_sample_id", "read_samples", "read_run_samples",
        "heartbeat_pipeline_run", "end_pipeline_run", "pipeline_liveness", "latest_shiftable_run_key",
        "recent_shiftable_run_keys", "live_serving_runs",
        "record_shift_event", "update_shift_event", "get_shift_event", "pending_shift_requests", "shift_events",
        "request_shift", "claim_shift_request", "expire_shift_requests",
        "get_or_create_job", "update_job", "claim_batch", "release_batch", "job_status", "jobs", "job_by_key",
        "jobs_newest_first", "transition_job", "batches_past_deadline", "expire_batch", "batch_result_counts",
        "write_result", "done_request_keys", "results",
        "write_observations", "read_observations", "observed_runs", "save_calibration", "calibrations",
        "latest_calibration", "save_api_file", "api_file", "api_file_content", "list_api_files", "api_file_readers",
        "delete_api_file", "prune_api_files", "add_file_batch", "prune_batch_results",
    }


def test_every_job_kind_round_trips_and_a_bad_kind_writes_nothing(store):
    for kind in InferenceJobKind:
        job = store.get_or_create_job(f"j-{kind}", kind)
        assert [j.id for j in store.jobs(kind=kind)] == [job]
    assert store.get_or_create_job("j-default") in [j.id for j in store.jobs(kind="batch")]  # the default
    with _refused(InferenceJobKind, "inference_jobs: kind"):
        store.get_or_create_job("j-bogus", "bogus")
    assert "j-bogus" not in {j.job_key for j in store.jobs()}
