"""The SQL store on SQLite and PostgreSQL: round trips, idempotence, and nothing partial on failure."""

from __future__ import annotations

import datetime as dt
import math

import pytest
from sqlalchemy import func, select

from flexpipe_dag.core.gear import Gear, GearEstimate, StagePlan
from flexpipe_dag.core.metrics import MetricSample, StageSample
from flexpipe_dag.sql import models as m


def _gear(gear_id="balanced-2s", rps_max=float("inf")) -> Gear:
    return Gear(gear_id=gear_id, kind="balanced", model_name="SmolLM2-135M", num_layers=30,
                stages=[StagePlan(stage_index=0, layer_start=0, layer_end=12, device_ids=["a"]),
                        StagePlan(stage_index=1, layer_start=12, layer_end=30, device_ids=["b", "c"])],
                micro_batch_size=4, rps_max=rps_max,
                estimate=GearEstimate(throughput_rps=3, tokens_per_s=300, ttft_p50_ms=10, ttft_p99_ms=20,
                                      tpot_p50_ms=5, tpot_p99_ms=9, bottleneck_stage=1))


def test_profile_versions_round_trip(store, lab_profile):
    v1 = store.save_profile(lab_profile)
    v2 = store.save_profile(lab_profile)
    assert (v1.version, v2.version) == (1, 2)
    assert [v.id for v in store.list_profile_versions("fragmented-lab")] == [v1.id, v2.id]
    info, loaded = store.latest_profile("fragmented-lab")
    assert info.id == v2.id
    assert loaded.devices == lab_profile.devices
    assert loaded.links == lab_profile.links
    with pytest.raises(KeyError):
        store.load_profile(10_000)


def test_gears_round_trip_and_replace(store, lab_profile):
    pv = store.save_profile(lab_profile)
    model_id = store.save_model("SmolLM2-135M", "bf16", 30, {"layers": 30})
    assert store.save_model("SmolLM2-135M", "bf16", 30, {"layers": 30}) == model_id
    store.save_gears([_gear(), _gear("latency-1s", rps_max=4.0)], pv.id, model_id)
    store.save_gears([_gear()], pv.id, model_id)  # a new plan: the current set; same key replaced
    gears = store.load_gears(pv.id, model_id)
    assert [g.gear_id for g in gears] == ["balanced-2s"]
    everything = store.load_gears(pv.id, model_id, current_only=False)
    assert sorted(g.gear_id for g in everything) == ["balanced-2s", "latency-1s"]
    assert store.load_gear("latency-1s") is not None  # an older plan's gear stays loadable by key
    got = next(g for g in gears if g.gear_id == "balanced-2s")
    assert got == _gear() and math.isinf(got.rps_max)
    with store.session() as s:
        assert s.scalar(select(func.count()).select_from(m.GearStageRow)) == 4


def test_health_tags_mark_and_clear(store):
    store.mark_unhealthy("g1", "lab", "SmolLM2-135M", "oom", "stage 1 OOM at 8 micro-batches")
    store.mark_unhealthy("g2", "other", "SmolLM2-135M", "timeout", "stage 0 hung")
    assert store.unhealthy_gear_keys("lab") == {"g1"}
    assert store.clear_health("profile refreshed", cluster_key="lab") == 1
    assert store.unhealthy_gear_keys() == {"g2"}
    assert len(store.health_tags(include_cleared=True)) == 2


def test_metric_samples_round_trip(store):
    samples = [MetricSample(t_s=2.0 * i, gear_id="g", source="sim", rps=1.5, completed=3, tokens_per_s=40.0,
                            queue_length=i, running=2, kv_used_fraction=0.25, ttft_p99_ms=12.0,
                            stages=(StageSample(0, 0.5, 1, 10, 100), StageSample(1, 0.9, 0, 12, 100)))
               for i in range(1, 4)]
    assert store.write_samples("run-1", samples) == 9
    store.write_samples("run-2", samples[:1])
    got = store.read_samples("run-1")
    assert [s for _, s in got] == samples
    last_id = got[1][0]
    assert [s.t_s for _, s in store.read_samples(after_id=last_id)] == [6.0, 2.0]


def test_metric_sample_row_missing_a_figure_is_named(store):
    """A row lacking a figure its scope always holds (not written by write_samples) is refused by name, not read
    back as a sample holding None."""
    from sqlalchemy import update

    from flexpipe_dag.core.errors import InputError

    store.write_samples("run-1", [MetricSample(t_s=2.0, gear_id="g", source="sim", rps=1.5, completed=3,
                                               tokens_per_s=40.0, queue_length=0, running=2, kv_used_fraction=0.25,
                                               stages=(StageSample(0, 0.5, 1, 10, 100),))])
    with store.session() as s:
        s.execute(update(m.MetricSampleRow).where(m.MetricSampleRow.scope == "stage").values(busy_fraction=None))
    with pytest.raises(InputError, match=r"metric_samples: row \d+: busy_fraction: NULL in a 'stage' row"):
        store.read_samples("run-1")
    with store.session() as s:
        s.execute(update(m.MetricSampleRow).where(m.MetricSampleRow.scope == "stage").values(busy_fraction=0.5))
        s.execute(update(m.MetricSampleRow).where(m.MetricSampleRow.scope == "pipeline").values(rps=None))
    with pytest.raises(InputError, match=r"row \d+: rps: NULL in a 'pipeline' row"):
        store.read_samples("run-1")


def test_results_are_idempotent_and_jobs_tracked(store):
    job = store.get_or_create_job("batch-1", source_path="prompts.jsonl")
    assert store.get_or_create_job("batch-1") == job
    assert store.write_result(job, "r1", prompt_tokens=5, output_token_ids=[1, 2, 3])
    assert not store.write_result(job, "r1", prompt_tokens=5, output_token_ids=[9])
    assert store.done_request_keys(job) == {"r1"}
    assert store.results(job)[0].output_token_ids == [1, 2, 3]
    store.update_job(job, status="done", total_requests=1)
    assert [j.job_key for j in store.jobs(status="done")] == ["batch-1"]


def test_shift_events(store):
    ev = store.record_shift_event("shift", "decided", "p99 over 1.2 x target for 3 samples",
                                  from_gear_key="balanced", to_gear_key="latency", trigger="latency_over",
                                  est_gain=0.4, migration_cost_s=float("inf"))
    store.update_shift_event(ev, "done", {"switch_s": 1.5})
    (got,) = store.shift_events()
    assert got.status == "done" and got.details == {"switch_s": 1.5} and got.migration_cost_s is None


def test_failed_write_leaves_nothing(store, lab_profile):
    pv = store.save_profile(lab_profile)
    model_id = store.save_model("m", "bf16", 30, {})
    with pytest.raises(AttributeError):
        store.save_gears([_gear(), "not a gear"], pv.id, model_id)  # second item fails mid-transaction
    assert store.load_gears(pv.id, model_id) == []


def test_gears_and_control_files_written_with_qps_names_still_read(tmp_path):
    """Request rates were named ``qps_*`` before ``rps_*``: saved gears and control files keep loading."""
    from flexpipe_dag.control.config import ControllerConfig
    from flexpipe_dag.core.gear_builders import load_gear

    doc = _gear(rps_max=7.5).model_dump(mode="json")
    doc["qps_min"], doc["qps_max"] = doc.pop("rps_min"), doc.pop("rps_max")
    path = tmp_path / "old-gear.json"
    import json

    path.write_text(json.dumps(doc))
    assert load_gear(path) == _gear(rps_max=7.5)
    assert ControllerConfig.model_validate({"qps_ema_alpha": 0.1}).rps_ema_alpha == 0.1


def test_old_and_new_rate_names_together_are_refused_by_name(tmp_path):
    import json

    from flexpipe_dag.control.config import ControllerConfig
    from flexpipe_dag.control.state import ControllerState
    from flexpipe_dag.core.errors import InputError
    from flexpipe_dag.core.gear_builders import load_gear

    doc = _gear(rps_max=7.5).model_dump(mode="json") | {"qps_max": 9.0}
    path = tmp_path / "both.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="qps_max .the old name. and rps_max are both given"):
        load_gear(path)
    with pytest.raises(ValueError, match="qps_ema_alpha .the old name. and rps_ema_alpha"):
        ControllerConfig.model_validate({"qps_ema_alpha": 0.1, "rps_ema_alpha": 0.2})
    # a cursor is machine-written: the new name wins whatever the key order
    for doc in ({"version": 2, "ema_qps": 3.0, "ema_rps": 9.0}, {"version": 2, "ema_rps": 9.0, "ema_qps": 3.0}):
        assert ControllerState.from_cursor(json.dumps(doc)).ema_rps == 9.0

# -- bad input is refused by name, nothing written ---------------------------------------------------
def _result_count(store) -> int:
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(m.RequestResult))


@pytest.mark.parametrize(("fields", "match"), [
    ({"job_id": 10_000}, r"request_results: job_id: no inference job with id 10000"),
    ({"job_id": "1"}, r"request_results: job_id: expected an integer, got '1'"),
    ({"request_key": None}, r"request_results: request_key: expected a string of at most 200 characters, got None"),
    ({"request_key": "k" * 201}, r"request_results: request_key: expected a string of at most 200 characters"),
    ({"prompt_tokens": None}, r"request_results: prompt_tokens: expected an integer, got None"),
    ({"prompt_tokens": 2.5}, r"request_results: prompt_tokens: expected an integer, got 2.5"),
    ({"output_token_ids": None}, r"request_results: output_token_ids: expected a list of integers, got None"),
    ({"output_token_ids": [1, None]}, r"request_results: output_token_ids\[1\]: expected an integer, got None"),
    ({"ttft_ms": float("nan")}, r"request_results: ttft_ms: expected a finite number or None, got nan"),
    ({"e2e_ms": float("inf")}, r"request_results: e2e_ms: expected a finite number or None, got inf"),
], ids=["unknown-job", "str-job-id", "no-request-key", "long-request-key", "no-prompt-tokens", "fraction-tokens",
        "no-token-ids", "none-token-id", "nan-ttft", "inf-e2e"])
def test_write_result_refuses_bad_input_instead_of_already_stored(store, fields, match):
    """Only a duplicate (job, request key) is 'already stored' (False); an unknown job or a missing or non-finite
    figure is refused by name, on SQLite (foreign keys by pragma) and PostgreSQL alike, and nothing is written."""
    from flexpipe_dag.core.errors import InputError

    job = store.get_or_create_job("batch-1")
    call = {"job_id": job, "request_key": "r1", "prompt_tokens": 5, "output_token_ids": [1, 2], **fields}
    with pytest.raises(InputError, match=match):
        store.write_result(call.pop("job_id"), call.pop("request_key"), **call)
    assert _result_count(store) == 0
    assert store.write_result(job, "r1", prompt_tokens=5, output_token_ids=[1, 2])  # the good call still writes
    assert not store.write_result(job, "r1", prompt_tokens=5, output_token_ids=[1, 2])


def test_write_result_lost_race_is_already_stored_and_other_integrity_errors_are_named(store, monkeypatch):
    """A concurrent writer storing the same request between the check and the insert is 'already stored'; an
    integrity error with no duplicate behind it is refused, never reported as stored."""
    from sqlalchemy.exc import IntegrityError

    from flexpipe_dag.core.errors import InputError
    from flexpipe_dag.sql.jobs import InferenceJobs

    job = store.get_or_create_job("batch-1")
    real_insert = InferenceJobs._insert_result

    def racing_insert(self, job_id, request_key, *args):
        real_insert(self, job_id, request_key, *args)  # the other writer wins
        raise IntegrityError("INSERT", {}, Exception("UNIQUE constraint failed"))

    monkeypatch.setattr(InferenceJobs, "_insert_result", racing_insert)
    assert store.write_result(job, "r1", prompt_tokens=5, output_token_ids=[1]) is False

    def failing_insert(self, *args):
        raise IntegrityError("INSERT", {}, Exception("CHECK constraint failed: something"))

    monkeypatch.setattr(InferenceJobs, "_insert_result", failing_insert)
    with pytest.raises(InputError, match=r"request_results: not written: CHECK constraint failed: something"):
        store.write_result(job, "r2", prompt_tokens=5, output_token_ids=[1])


def _good_sample(t_s: float = 2.0, **fields) -> MetricSample:
    stage = {k.removeprefix("stage_"): fields.pop(k) for k in list(fields) if k.startswith("stage_")}
    return MetricSample(**{"t_s": t_s, "gear_id": "g", "source": "sim", "rps": 1.5, "completed": 3,
                           "tokens_per_s": 40.0, "queue_length": 0, "running": 2, "kv_used_fraction": 0.25,
                           "ttft_p99_ms": 12.0, **fields},
                        stages=(StageSample(0, 0.5, 1, 10, 100),
                                StageSample(**{"stage_index": 1, "busy_fraction": 0.9, "queue_length": 0,
                                               "kv_blocks_used": 12, "kv_blocks_total": 100, **stage})))


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(("fields", "match"), [
    ({"rps": NAN}, r"^metric_samples: rps: expected a finite number, got nan \(batch item 1\)$"),
    ({"t_s": NAN}, r"^metric_samples: t_s: expected a finite number, got nan"),
    ({"tokens_per_s": INF}, r"^metric_samples: tokens_per_s: expected a finite number, got inf"),
    ({"kv_used_fraction": -INF}, r"^metric_samples: kv_used_fraction: expected a finite number, got -inf"),
    ({"rps": None}, r"^metric_samples: rps: expected a finite number, got None"),
    ({"completed": NAN}, r"^metric_samples: completed: expected an integer, got nan"),
    ({"queue_length": 2.5}, r"^metric_samples: queue_length: expected an integer, got 2.5"),
    ({"ttft_p99_ms": NAN}, r"^metric_samples: ttft_p99_ms: expected a finite number or None, got nan"),
    ({"e2e_p50_ms": INF}, r"^metric_samples: e2e_p50_ms: expected a finite number or None, got inf"),
    ({"gear_id": None}, r"^metric_samples: gear_id: expected a string of at most 200 characters, got None"),
    ({"stage_busy_fraction": NAN}, r"^metric_samples: stages\[1\]\.busy_fraction: expected a finite number, got nan"),
    ({"stage_kv_blocks_total": None}, r"^metric_samples: stages\[1\]\.kv_blocks_total: expected an integer, got None"),
], ids=["nan-rps", "nan-t_s", "inf-tokens", "-inf-kv", "none-rps", "nan-completed", "fraction-queue", "nan-ttft",
        "inf-e2e", "no-gear", "nan-stage-busy", "none-stage-kv"])
def test_write_samples_refuses_non_finite_figures(store, fields, match):
    """NaN and inf are no figures (SQLite would store NaN as NULL, and every later read_samples of the run would
    fail); a percentile with no value is None, never NaN. The field is named and nothing of the batch is written."""
    from flexpipe_dag.core.errors import InputError

    with pytest.raises(InputError, match=match):
        store.write_samples("run-1", [_good_sample(), _good_sample(**{"t_s": 4.0, **fields})])
    with store.session() as s:
        assert s.scalar(select(func.count()).select_from(m.MetricSampleRow)) == 0
    assert store.read_samples("run-1") == []


def test_write_samples_keeps_none_percentiles_and_whole_number_floats(store):
    """None percentiles (no request finished in the window) and counts given as whole-number floats or numpy
    numbers are stored and read back as plain values."""
    import numpy as np

    sample = _good_sample(ttft_p99_ms=None, rps=np.float64(1.5), completed=np.int64(3), queue_length=4.0)
    assert store.write_samples("run-1", [sample]) == 3
    ((_, got),) = store.read_samples("run-1")
    assert got == _good_sample(ttft_p99_ms=None, queue_length=4)
    assert type(got.queue_length) is int and type(got.rps) is float and got.ttft_p99_ms is None


def _job_row(store, job_key: str) -> tuple:
    (job,) = [j for j in store.jobs() if j.job_key == job_key]
    return job.id, job.status, job.total_requests, job.malformed_rows, job.error, job.gear_key


@pytest.mark.parametrize(("fields", "match"), [
    ({"id": 777}, r"^inference_jobs: id: not a field update_job sets; expected status, total_requests, "
                  r"malformed_rows, admissions, error, gear_key or results_expire_at$"),
    ({"status": "done", "results_expire_at": dt.datetime(2026, 1, 1)},  # naive: which zone is not known
     r"^inference_jobs: results_expire_at: expected an aware datetime or None"),
    ({"status": "done", "job_key": "other"}, r"^inference_jobs: job_key: not a field update_job sets"),
    ({"totl_requests": 3}, r"^inference_jobs: totl_requests: not a field update_job sets"),
    ({"status": "done", "total_requests": None}, r"^inference_jobs: total_requests: expected an integer, got None$"),
    ({"malformed_rows": 1.5}, r"^inference_jobs: malformed_rows: expected an integer, got 1.5$"),
    ({"error": 42}, r"^inference_jobs: error: expected a string or None, got 42$"),
    ({"gear_key": "g" * 201}, r"^inference_jobs: gear_key: expected a string of at most 200 characters or None"),
], ids=["primary-key", "naive-expiry", "job-key-with-status", "typo", "none-total", "fraction-malformed", "int-error", "long-gear"])
def test_update_job_sets_only_its_fields(store, fields, match):
    """update_job sets what its callers set (status, counts, error, gear) and refuses any other attribute (the
    primary key, the job key, a typo silently ignored before) by name, writing nothing of the call."""
    from flexpipe_dag.core.errors import InputError

    job = store.get_or_create_job("batch-1")
    before = _job_row(store, "batch-1")
    with pytest.raises(InputError, match=match):
        store.update_job(job, **fields)
    assert _job_row(store, "batch-1") == before
    store.update_job(job, status="running", total_requests=3, malformed_rows=1, error=None, gear_key="g")
    assert _job_row(store, "batch-1") == (job, "running", 3, 1, None, "g")


@pytest.mark.parametrize(("fields", "match"), [
    ({"reason": None}, r"^shift_events: reason: expected a string, got None$"),
    ({"reason": 3}, r"^shift_events: reason: expected a string, got 3$"),
    ({"est_gain": NAN}, r"^shift_events: est_gain: expected a number \(inf: unbounded, stored as NULL\) or None, "
                        r"got nan$"),
    ({"migration_cost_s": NAN}, r"^shift_events: migration_cost_s: expected a number .* got nan$"),
    ({"est_gain": "0.4"}, r"^shift_events: est_gain: expected a number .* got '0.4'$"),
    ({"trigger": "t" * 41}, r"^shift_events: trigger: expected a string of at most 40 characters or None"),
    ({"to_gear_key": "g" * 201}, r"^shift_events: to_gear_key: expected a string of at most 200 characters"),
], ids=["no-reason", "int-reason", "nan-gain", "nan-cost", "str-gain", "long-trigger", "long-gear"])
def test_record_shift_event_refuses_bad_input(store, fields, match):
    """A missing reason was a raw IntegrityError and a NaN gain or cost was stored as NULL (SQLite) or NaN
    (PostgreSQL); both are refused by name and nothing is written. inf stays 'unbounded' (NULL)."""
    from flexpipe_dag.core.errors import InputError

    call = {"reason": "p99 over target", "est_gain": 0.4, **fields}
    with pytest.raises(InputError, match=match):
        store.record_shift_event("shift", "decided", call.pop("reason"), **call)
    assert store.shift_events() == []
    ev = store.record_shift_event("shift", "decided", "r", est_gain=INF, migration_cost_s=2.5)
    got = store.get_shift_event(ev)
    assert (got.est_gain, got.migration_cost_s) == (None, 2.5)
