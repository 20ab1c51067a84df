"""A Batch API batch's completion window: a batch not ended 24 h after it was created expires, as OpenAI's do.

Before, a batch had no deadline (``expires_at`` null): one the troughs never reached waited for ever, and a client
polling for ``completed | failed | expired | cancelled`` polled for ever. Now the first server's runner to see the
deadline pass ends it ``expired``: its finished lines stay in the output file, every other line (those in flight
too, cancelled in the pipeline) is an error-file line ``batch_expired`` with no response, in one transaction.

The HTTP routes run in-process over the real SQL store (the OpenAI SDK's transport is FastAPI's test client); the
engine and router are the batch-runner tests' fakes beside the real ones (no model needed: the deadline is what is
tested, not generation).
"""

from __future__ import annotations

import datetime as dt
import json
import time

import pytest
from sqlalchemy import update

from flexpipe_dag.serving.frontdoor.batches import BATCH_EXPIRED_ERROR, BatchRunner, batch_object, create_batch
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.jobs import BatchDeadlineEnd
from tests.support import wait_until
from tests.test_frontdoor_batch_runner import MODEL, _Engine, _Router
from tests.test_frontdoor_files import _input, sdk  # noqa: F401 - the SDK fixture

DAY_S = 24 * 3600
EXPIRED_TEXT = json.dumps({"error": BATCH_EXPIRED_ERROR})


class _CancellingRouter(_Router):
    """The fake router, with the real one's ``cancel`` (True: the request was still running)."""

    def __init__(self, delay_s: float):
        super().__init__(delay_s)
        self.cancelled: list[str] = []

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True


def _past_deadline(store, batch_id: str, ago_s: float = 1.0) -> None:
    """Move batch ``batch_id``'s deadline into the past (as if 24 h had gone by)."""
    past = dt.datetime.fromtimestamp(time.time() - ago_s, dt.UTC)
    with store.session() as s:
        s.execute(update(m.InferenceJob).where(m.InferenceJob.job_key == batch_id).values(expires_at=past))


def _answer(store, batch_id: str, custom_id: str, ok: bool = True) -> None:
    store.write_result(store.job_by_key(batch_id).id, custom_id, prompt_tokens=3, output_token_ids=[7],
                       status="done" if ok else "failed",
                       output_text=json.dumps({"status_code": 200 if ok else 400,
                                               "body": {"id": custom_id} if ok else {"error": {"code": "bad"}}}))


def _lines(sdk_client, file_id: str) -> list[dict]:
    return [json.loads(x) for x in sdk_client.files.content(file_id).text.splitlines()]


def test_a_batch_not_ended_in_its_window_expires_keeping_its_finished_lines(sdk, store):  # noqa: F811
    upload = sdk.files.create(file=("in.jsonl", _input(4)), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.expires_at is not None and batch.expires_at - batch.created_at == DAY_S and batch.expired_at is None
    _answer(store, batch.id, "l-0")
    _answer(store, batch.id, "l-1", ok=False)
    engine = _Engine(_CancellingRouter(delay_s=0.01))
    logged: list[str] = []
    runner = BatchRunner(store, engine, MODEL, log=logged.append, expiry_check_s=0)
    store.update_job(store.job_by_key(batch.id).id, status="paused")  # the tide held it back all day
    _past_deadline(store, batch.id)
    runner._step()
    got = sdk.batches.retrieve(batch.id)
    assert got.status == "expired" and got.expired_at is not None and abs(got.expired_at - time.time()) < 5
    assert (got.request_counts.total, got.request_counts.completed, got.request_counts.failed) == (4, 1, 3)
    assert engine.router.seen == []  # nothing served after the deadline
    assert [x["custom_id"] for x in _lines(sdk, got.output_file_id)] == ["l-0"]
    errors = {x["custom_id"]: x for x in _lines(sdk, got.error_file_id)}
    assert set(errors) == {"l-1", "l-2", "l-3"}
    assert errors["l-1"]["response"]["status_code"] == 400  # served and refused: as before
    for cid in ("l-2", "l-3"):  # never served: OpenAI's expired line
        assert errors[cid]["response"] is None and errors[cid]["error"] == BATCH_EXPIRED_ERROR
    assert any("expired (its 24h completion window passed): 2 of 4 lines answered batch_expired" in x for x in logged)
    assert sdk.batches.cancel(batch.id).status == "expired"  # ended: returned as it is
    runner._step()  # once
    assert len(store.results(store.job_by_key(batch.id).id)) == 4
    assert engine.metrics.registry.get_sample_value("flexpipe_requests_total", {"endpoint": "batch", "outcome": "expired"}) == 2


def test_lines_in_flight_when_the_window_closes_are_cancelled_and_answered_expired(sdk, store):  # noqa: F811
    upload = sdk.files.create(file=("in.jsonl", _input(5)), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    engine = _Engine(_CancellingRouter(delay_s=0.5))
    runner = BatchRunner(store, engine, MODEL, max_inflight=2, log=lambda _: None, expiry_check_s=0)
    engine.router.on_result = runner.on_result
    runner._step()  # running, two lines in flight
    job_id = store.job_by_key(batch.id).id
    assert len(engine.router.seen) == 2 and runner.inflight(job_id) == 2
    _past_deadline(store, batch.id)
    runner._step()
    assert sorted(engine.router.cancelled) == sorted(engine.router.seen) and runner.inflight(job_id) == 0
    time.sleep(0.8)  # the fake router answers them all the same: dropped, never a second row
    got = sdk.batches.retrieve(batch.id)
    assert got.status == "expired" and got.output_file_id is None
    assert (got.request_counts.completed, got.request_counts.failed) == (0, 5)
    assert len(_lines(sdk, got.error_file_id)) == 5 and len(store.results(job_id)) == 5


def test_a_batch_that_ends_in_time_never_expires_and_one_expires_once(store):
    store.save_api_file("file-a", "batch", "in.jsonl", _input(3))
    done = create_batch(store, "file-a", "/v1/completions", "24h", None)["id"]
    store.update_job(store.job_by_key(done).id, status="done")
    _past_deadline(store, done)
    late = create_batch(store, "file-a", "/v1/completions", "24h", None)["id"]
    fresh = create_batch(store, "file-a", "/v1/completions", "24h", None)["id"]
    _past_deadline(store, late)
    assert [j.job_key for j in store.batches_past_deadline()] == [late]
    keys = ["l-0", "l-1", "l-2"]
    common = {"output_text": EXPIRED_TEXT, "results_expire_at": dt.datetime.now(dt.UTC) + dt.timedelta(days=30)}
    for batch_id in (done, fresh):  # ended in time / not due: untouched
        assert store.expire_batch(store.job_by_key(batch_id).id, keys, **common) is None
        assert store.results(store.job_by_key(batch_id).id) == []
    assert store.job_by_key(fresh).status == "queued"
    _answer(store, late, "l-1")
    late_id = store.job_by_key(late).id
    assert store.expire_batch(late_id, keys, **common) == BatchDeadlineEnd("expired", 2)  # two servers: one does it
    assert store.expire_batch(late_id, keys, **common) is None
    assert {r.request_key: r.status for r in store.results(late_id)} == {"l-1": "done", "l-0": "failed", "l-2": "failed"}
    job = store.job_by_key(late)
    assert job.status == "expired" and job.results_expire_at is not None
    assert batch_object(store, job, None)["expired_at"] is not None
    assert store.batches_past_deadline() == []
    from flexpipe_dag.core.errors import InputError

    with pytest.raises(InputError, match="request_key"):  # refused whole: nothing written
        store.expire_batch(store.job_by_key(fresh).id, ["ok", "x" * 201], **common)
    with pytest.raises(InputError, match="expires_at: expected an aware datetime"):
        store.add_file_batch("batch_naive", "file-a", {}, 1, expires_at=dt.datetime(2030, 1, 1))
    assert store.job_by_key("batch_naive") is None


def test_only_a_24h_window_is_accepted(sdk):  # noqa: F811
    from openai import BadRequestError

    upload = sdk.files.create(file=("in.jsonl", _input(1)), purpose="batch")
    with pytest.raises(BadRequestError, match="completion_window: only 24h is supported, got '1h'"):
        sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="1h")  # type: ignore
    with pytest.raises(BadRequestError) as refused:  # a long value is not echoed whole
        sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="9" * 100_000)  # type: ignore
    assert len(str(refused.value)) < 1000


def test_a_batch_stored_before_the_upgrade_gets_a_whole_window_from_it(store):
    from flexpipe_dag.core.clock import as_utc
    from flexpipe_dag.core.errors import InputError
    from flexpipe_dag.sql.store import downgrade, migrate

    store.save_api_file("file-old", "batch", "in.jsonl", _input(2))
    waiting = create_batch(store, "file-old", "/v1/completions", "24h", None)["id"]
    ended = create_batch(store, "file-old", "/v1/completions", "24h", None)["id"]
    store.update_job(store.job_by_key(ended).id, status="done")
    store.get_or_create_job("dagster-batch", "batch")  # a batch_inference job, not the Batch API's: no deadline
    with pytest.raises(InputError, match="expires_at of 1 batches not ended"):
        downgrade(store.engine, "0016")
    downgrade(store.engine, "0016", force=True)
    migrate(store.engine)
    assert store.job_by_key(ended).expires_at is None and store.job_by_key("dagster-batch").expires_at is None
    deadline = as_utc(store.job_by_key(waiting).expires_at)
    assert abs((deadline - dt.datetime.now(dt.UTC)).total_seconds() - DAY_S) < 60  # not at once: a day from now
    assert store.batches_past_deadline() == []
    # a forced downgrade leaves no status the old code cannot read: an expired batch reads failed, saying why
    _past_deadline(store, waiting)
    store.expire_batch(store.job_by_key(waiting).id, ["l-0", "l-1"], output_text=EXPIRED_TEXT,
                       results_expire_at=dt.datetime.now(dt.UTC) + dt.timedelta(days=30))
    with pytest.raises(InputError, match="'expired' of 1 batches \\(they become 'failed'"):
        downgrade(store.engine, "0016")
    downgrade(store.engine, "0016", force=True)
    migrate(store.engine)
    old = store.job_by_key(waiting)
    assert old.status == "failed" and old.error.startswith("expired: its completion window passed")


def test_a_served_batch_runs_to_completion_inside_its_window(store):
    """The runner's deadline check leaves a batch in its window alone: it completes as before."""
    store.save_api_file("file-c", "batch", "in.jsonl", _input(3))
    batch_id = create_batch(store, "file-c", "/v1/completions", "24h", None)["id"]
    engine = _Engine(_CancellingRouter(delay_s=0.01))
    runner = BatchRunner(store, engine, MODEL, poll_s=0.01, log=lambda _: None)
    engine.router.on_result = runner.on_result
    runner.start()
    try:
        wait_until(lambda: store.job_by_key(batch_id).status == "done", timeout_s=30, what="batch done")
    finally:
        runner.stop()
    assert engine.router.cancelled == [] and batch_object(store, store.job_by_key(batch_id), None)["expired_at"] is None


def test_the_runner_looks_for_passed_windows_at_most_every_expiry_check_s(store):
    """The poll runs every half second; the deadline look (a 24-h window) only every ``expiry_check_s``."""
    store.save_api_file("file-t", "batch", "in.jsonl", _input(1))
    first, second = (create_batch(store, "file-t", "/v1/completions", "24h", None)["id"] for _ in range(2))
    store.update_job(store.job_by_key(first).id, status="paused")
    store.update_job(store.job_by_key(second).id, status="paused")
    runner = BatchRunner(store, _Engine(_CancellingRouter(delay_s=0.01)), MODEL, log=lambda _: None,
                         expiry_check_s=3600)
    _past_deadline(store, first)
    runner._step()
    _past_deadline(store, second)
    runner._step()
    assert (store.job_by_key(first).status, store.job_by_key(second).status) == ("expired", "paused")
    runner._expiry_checked_s -= 3600  # an hour later
    runner._step()
    assert store.job_by_key(second).status == "expired"


def test_no_line_is_submitted_once_the_window_has_passed_though_not_yet_expired(store):
    """Between two looks (``expiry_check_s``) a batch past its deadline was served on: 445 lines in 4 s on a live
    runner. The runner reads the deadline from the row it already holds."""
    store.save_api_file("file-s", "batch", "in.jsonl", _input(3))
    batch_id = create_batch(store, "file-s", "/v1/completions", "24h", None)["id"]
    engine = _Engine(_CancellingRouter(delay_s=0.01))
    runner = BatchRunner(store, engine, MODEL, log=lambda _: None, expiry_check_s=3600)
    runner._expiry_checked_s = time.monotonic()  # just looked
    _past_deadline(store, batch_id)
    runner._step()
    assert engine.router.seen == [] and store.job_by_key(batch_id).status == "queued"


def test_the_owners_lines_in_flight_are_cancelled_when_another_server_expires_the_batch(store):
    """Server B expired a batch whose lines were in flight on its owner A: A ran them to ``max_tokens`` and counted
    their late results in its metrics a second time. A now cancels them at its next look."""
    store.save_api_file("file-o", "batch", "in.jsonl", _input(4))
    batch_id = create_batch(store, "file-o", "/v1/completions", "24h", None)["id"]
    store.heartbeat_pipeline_run("fd-a", "serve", "g")
    store.heartbeat_pipeline_run("fd-b", "serve", "g")
    owner_engine = _Engine(_CancellingRouter(delay_s=0.6))
    owner = BatchRunner(store, owner_engine, MODEL, max_inflight=2, log=lambda _: None, run_key="fd-a",
                        expiry_check_s=0)
    owner_engine.router.on_result = owner.on_result
    owner._step()  # claimed by fd-a, two lines in flight there
    job_id = store.job_by_key(batch_id).id
    assert owner.inflight(job_id) == 2
    _past_deadline(store, batch_id)
    other = BatchRunner(store, _Engine(_CancellingRouter(delay_s=0.01)), MODEL, log=lambda _: None, run_key="fd-b",
                        expiry_check_s=0)
    other._step()
    assert store.job_by_key(batch_id).status == "expired" and owner_engine.router.cancelled == []
    owner._step()
    assert sorted(owner_engine.router.cancelled) == sorted(owner_engine.router.seen) and owner.inflight(job_id) == 0
    time.sleep(0.9)  # the fake router answers them all the same: dropped, not counted
    assert owner_engine.metrics.registry.get_sample_value(
        "flexpipe_requests_total", {"endpoint": "batch", "outcome": "length"}) is None
    assert {r.status for r in store.results(job_id)} == {"failed"} and len(store.results(job_id)) == 4


def test_a_line_answered_as_the_window_closes_is_counted_once(store):
    """A line whose result came while the batch expired: its row is kept (written first) or it is batch_expired,
    never both, and the metrics count it once."""
    store.save_api_file("file-l", "batch", "in.jsonl", _input(2))
    batch_id = create_batch(store, "file-l", "/v1/completions", "24h", None)["id"]
    engine = _Engine(_CancellingRouter(delay_s=0.01))
    runner = BatchRunner(store, engine, MODEL, log=lambda _: None, expiry_check_s=0)
    job = store.job_by_key(batch_id)
    line = runner._job_lines(job)[0]
    store.update_job(job.id, status="paused")
    _past_deadline(store, batch_id)
    runner._step()  # expired: both lines batch_expired
    assert runner._write(job.id, line, 200, {"choices": [{"finish_reason": "length"}]}, [7], 3) is False
    assert engine.metrics.registry.get_sample_value(
        "flexpipe_requests_total", {"endpoint": "batch", "outcome": "length"}) is None
    assert engine.metrics.registry.get_sample_value(
        "flexpipe_requests_total", {"endpoint": "batch", "outcome": "expired"}) == 2


def test_a_batch_whose_lines_were_all_answered_completes_rather_than_expires(sdk, store):  # noqa: F811
    """Its last row came, then the tide paused it before the runner marked it done; the window passed. OpenAI reports
    such a batch completed, with no error file: it was reported expired with nothing expired."""
    upload = sdk.files.create(file=("in.jsonl", _input(2)), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    _answer(store, batch.id, "l-0")
    _answer(store, batch.id, "l-1")
    store.update_job(store.job_by_key(batch.id).id, status="paused")
    _past_deadline(store, batch.id)
    logged: list[str] = []
    BatchRunner(store, _Engine(_CancellingRouter(delay_s=0.01)), MODEL, log=logged.append)._step()
    got = sdk.batches.retrieve(batch.id)
    assert got.status == "completed" and got.completed_at is not None and got.expired_at is None
    assert got.output_file_id is not None and got.error_file_id is None
    assert any("every line was answered when its completion window passed" in x for x in logged), logged


def test_a_line_written_while_postgresql_expires_the_batch_is_not_blocked_nor_lost(store):
    """On PostgreSQL the expiry locked the job row ``FOR UPDATE``; a result row's insert takes a key share of it (its
    foreign key), so a line answered at that moment waited on the expiry while the expiry waited on the line's row: a
    deadlock, the line's real response lost to ``batch_expired``. The lock is now ``FOR NO KEY UPDATE``."""
    import threading

    from sqlalchemy import event

    if store.engine.dialect.name != "postgresql":
        pytest.skip("row-lock modes are PostgreSQL's (SQLite's BEGIN IMMEDIATE serialises every writer)")
    store.save_api_file("file-pg", "batch", "in.jsonl", _input(2))
    batch_id = create_batch(store, "file-pg", "/v1/completions", "24h", None)["id"]
    job_id = store.job_by_key(batch_id).id
    _past_deadline(store, batch_id)
    locked, go = threading.Event(), threading.Event()

    def hold_after_the_lock(conn, cursor, statement, parameters, context, executemany):
        if threading.current_thread() is expirer and "SELECT request_results.request_key" in statement:
            locked.set()  # the job row is locked by now
            go.wait(10)

    outcome: dict = {}
    expirer = threading.Thread(target=lambda: outcome.update(ended=store.expire_batch(
        job_id, ["l-0", "l-1"], output_text=EXPIRED_TEXT,
        results_expire_at=dt.datetime.now(dt.UTC) + dt.timedelta(days=30))))
    event.listen(store.engine, "before_cursor_execute", hold_after_the_lock)
    try:
        expirer.start()
        assert locked.wait(10)
        t0 = time.monotonic()
        _answer(store, batch_id, "l-1")  # the line's row, written while the expiry holds the job row
        outcome["writer_s"] = time.monotonic() - t0
        go.set()
        expirer.join(15)
    finally:
        event.remove(store.engine, "before_cursor_execute", hold_after_the_lock)
        go.set()
    assert outcome["writer_s"] < 2.0  # not blocked behind the expiry's lock
    assert outcome["ended"] is not None and outcome["ended"].lines_expired == 1
    assert {r.request_key: r.status for r in store.results(job_id)} == {"l-0": "failed", "l-1": "done"}
