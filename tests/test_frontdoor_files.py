"""Files and batches that hold for days: cursor pages the OpenAI SDKs walk to the end, files that expire or are
deleted (never under a batch that still reads them), and the store's prune of expired files.

The HTTP routes run in-process (FastAPI's test client as the OpenAI SDK's transport) over the real SQL store; the
engine is the batch-runner tests' fake (no model is needed: these routes never generate).
"""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from openai import BadRequestError, ConflictError, NotFoundError, OpenAI

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.serving.frontdoor.app import (
    DEFAULT_BATCH_FILE_EXPIRY_S,
    BatchAPI,
    create_app,
)
from flexpipe_dag.serving.frontdoor.batches import BatchRunner, create_batch
from tests.support import wait_until
from tests.test_frontdoor_batch_runner import MODEL, _Engine, _Router


def _input(n: int, tag: str = "") -> bytes:
    lines = [{"custom_id": f"{tag}l-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": [1, 2, 3 + i], "max_tokens": 3, "temperature": 0}} for i in range(n)]
    return "\n".join(json.dumps(x) for x in lines).encode()


@pytest.fixture
def sdk(store):
    """The OpenAI SDK on the front door's routes over ``store``."""
    app = create_app(_Engine(_Router(delay_s=0.01)), MODEL, batch_api=BatchAPI(store))
    with TestClient(app) as http:
        yield OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_the_sdks_auto_pagination_walks_every_batch_and_file_once(sdk):
    """``after`` was ignored: ``has_more`` was true and the SDK's auto-pagination asked for the first page again,
    forever. Each page now starts after the cursor."""
    files = [sdk.files.create(file=(f"in{i}.jsonl", _input(2, f"f{i}")), purpose="batch") for i in range(5)]
    batches = [sdk.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
               for f in files]
    walked = [b.id for b in sdk.batches.list(limit=2)]  # 3 pages, then has_more is false
    assert walked == [b.id for b in reversed(batches)]
    newest_first = [f.id for f in sdk.files.list(limit=2)]
    assert newest_first == [f.id for f in reversed(files)]
    assert [f.id for f in sdk.files.list(limit=3, order="asc")] == [f.id for f in files]
    page = sdk.batches.list(limit=2, after=batches[2].id)
    assert [b.id for b in page.data] == [batches[1].id, batches[0].id] and not page.has_more
    with pytest.raises(BadRequestError, match="after: no batch 'batch_nope'"):  # batches are never deleted
        sdk.batches.list(after="batch_nope")
    with pytest.raises(BadRequestError, match="after: no stored file 'file-nope'"):
        sdk.files.list(after="file-nope")
    with pytest.raises(BadRequestError, match="order: expected 'asc' or 'desc'"):
        sdk.files.list(order="sideways")  # type: ignore[arg-type]


def test_a_file_expires_as_asked_or_after_openais_30_days(sdk, store):
    before = int(time.time())
    default = sdk.files.create(file=("a.jsonl", _input(1)), purpose="batch")
    assert default.expires_at is not None
    assert 0 <= default.expires_at - before - DEFAULT_BATCH_FILE_EXPIRY_S <= 2
    hour = sdk.files.create(file=("b.jsonl", _input(1)), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 3600})
    assert hour.expires_at is not None and 0 <= hour.expires_at - hour.created_at - 3600 <= 2
    assert sdk.files.retrieve(hour.id).expires_at == hour.expires_at
    for seconds, problem in ((59, "got 59"), (30 * 86400 + 1, "got 2592001"), ("1e4", "got '1e4'"),
                             ("-3600", "got '-3600'"), ("9" * 5000, "got '9999"), ("", "got ''")):
        with pytest.raises(BadRequestError, match=f"expires_after\\[seconds\\]: expected a whole number .*{problem}"):
            sdk.files.create(file=("c.jsonl", _input(1)), purpose="batch",
                             expires_after={"anchor": "created_at", "seconds": seconds})  # type: ignore[typeddict-item]
    with pytest.raises(BadRequestError, match="expires_after\\[anchor\\]: expected 'created_at', got 'last_use'"):
        sdk.files.create(file=("c.jsonl", _input(1)), purpose="batch",
                         expires_after={"anchor": "last_use", "seconds": 3600})  # type: ignore[typeddict-item]
    with pytest.raises(BadRequestError, match="expires_after\\[anchor\\]: expected 'created_at', got nothing"):
        sdk.files.create(file=("c.jsonl", _input(1)), purpose="batch",
                         expires_after={"seconds": 3600})  # type: ignore[typeddict-item]
    assert len(sdk.files.list().data) == 2  # none of the refused uploads was stored
    # an hour and a second later: the file is neither listed nor served, nor a batch's input
    later = time.time() + 3601
    assert [f.id for f in store.list_api_files(10, now_s=later)[0]] == [default.id]
    _expire(store, hour.id)
    for call in (lambda: sdk.files.retrieve(hour.id), lambda: sdk.files.content(hour.id),
                 lambda: sdk.files.delete(hour.id),  # as GET says: no such file (a prune deletes it)
                 lambda: sdk.batches.create(input_file_id=hour.id, endpoint="/v1/completions",
                                            completion_window="24h")):
        with pytest.raises(NotFoundError, match=f"No such file: {hour.id}"):
            call()
    assert [f.id for f in sdk.files.list().data] == [default.id]


def _expire(store, file_id: str) -> None:
    """Make ``file_id`` expired a second ago (as if its time had passed)."""
    import datetime as dt

    from sqlalchemy import update

    from flexpipe_dag.sql import models as m

    with store.session() as s:
        s.execute(update(m.ApiFile).where(m.ApiFile.id == file_id)
                  .values(expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)))


def test_a_file_is_deleted_only_once_no_unfinished_batch_reads_it(sdk, store):
    upload = sdk.files.create(file=("in.jsonl", _input(3)), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(ConflictError, match=f"input of batch\\(es\\) that have not ended: {batch.id}"):
        sdk.files.delete(upload.id)
    assert sdk.files.retrieve(upload.id).id == upload.id  # nothing was deleted
    job = store.job_by_key(batch.id)
    for n, cid in enumerate(("l-2", "l-0")):  # two lines answered, in this order, then the batch is cancelled
        store.write_result(job.id, cid, prompt_tokens=3, output_token_ids=[7], status="done",
                           output_text=json.dumps({"status_code": 200, "body": {"n": n}}))
    assert sdk.batches.cancel(batch.id).status == "cancelled"
    in_order = sdk.files.content(f"{batch.id}-output").text
    assert [json.loads(x)["custom_id"] for x in in_order.splitlines()] == ["l-0", "l-2"]  # the input's order
    deleted = sdk.files.delete(upload.id)
    assert deleted.deleted and deleted.id == upload.id
    with pytest.raises(NotFoundError):
        sdk.files.retrieve(upload.id)
    with pytest.raises(NotFoundError):
        sdk.files.delete(upload.id)
    # the output is still served, in the order its rows were written (the input's order went with the input)
    assert [json.loads(x)["custom_id"] for x in sdk.files.content(f"{batch.id}-output").text.splitlines()] \
        == ["l-2", "l-0"]
    assert sdk.batches.retrieve(batch.id).request_counts.completed == 2
    with pytest.raises(BadRequestError, match="is a batch's output or error file"):
        sdk.files.delete(f"{batch.id}-output")
    with pytest.raises(NotFoundError):  # no line failed: no error file, as the batch object says
        sdk.files.content(f"{batch.id}-errors")
    assert sdk.batches.retrieve(batch.id).error_file_id is None


def test_a_client_deletes_each_file_as_it_walks_the_list(sdk, store):
    """The cursor is the id the client has just deleted: its row stays a day as a cursor (content gone), so the
    walk goes on; a prune a day later removes it."""
    files = [sdk.files.create(file=(f"in{i}.jsonl", _input(1, f"f{i}")), purpose="batch") for i in range(5)]
    walked = []
    for f in sdk.files.list(limit=2):
        walked.append(f.id)
        assert sdk.files.delete(f.id).deleted
    assert walked == [f.id for f in reversed(files)] and sdk.files.list().data == []
    assert store.api_file_content(files[0].id) is None
    assert store.prune_api_files().files == 0 and store.list_api_files(1, after=files[0].id)[0] == []  # still a cursor
    pruned = store.prune_api_files(now_s=time.time() + 86401)
    assert pruned.cursors == 5 and "5 row(s) of files deleted over a day ago" in pruned.describe()
    with pytest.raises(InputError, match="after: no stored file"):
        store.list_api_files(1, after=files[0].id)


def test_repeated_or_misplaced_form_fields_are_refused_naming_them(store):
    app = create_app(_Engine(_Router(delay_s=0.01)), MODEL, batch_api=BatchAPI(store))
    with TestClient(app) as http:
        one = ("a.jsonl", _input(1), "application/jsonl")
        cases = [({"purpose": ["evil", "batch"]}, [("file", one)], "purpose: sent 2 times"),
                 ({"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": ["99", "3600"]},
                  [("file", one)], "expires_after[seconds]: sent 2 times"),
                 ({"purpose": "batch"}, [("file", one), ("file", ("b.jsonl", _input(1), "application/jsonl"))],
                  "file: sent 2 times"),
                 ({"purpose": "batch", "file": '{"custom_id": "secret"}'}, [("x", one)],
                  "file: expected a file part")]
        for data, files, message in cases:
            answer = http.post("/v1/files", data=data, files=files)
            error = answer.json()["error"]
            assert answer.status_code == 400 and message in error["message"], answer.text
            assert error["param"] == message.split(":")[0] and "secret" not in error["message"]
        for headers, content in (({"content-type": "multipart/form-data"}, b"xx"),
                                 ({"content-type": "multipart/form-data; boundary=zz"}, b"xx")):
            answer = http.post("/v1/files", content=content, headers=headers)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "file", answer.text
            assert "not valid multipart/form-data" in answer.json()["error"]["message"]
        answer = http.get("/v1/batches", params={"limit": "abc"})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "limit"
        assert answer.json()["error"]["message"].startswith("limit: ")
        assert http.get("/v1/files").json()["data"] == []  # nothing was stored


def test_a_batch_is_not_created_on_a_file_deleted_meanwhile_and_a_failed_batch_says_why(sdk, store):
    upload = sdk.files.create(file=("in.jsonl", _input(2)), purpose="batch")
    real = store.api_file_content

    def deleted_after_the_read(file_id):  # the delete lands between the batch's check of the file and its insert
        content = real(file_id)
        assert store.delete_api_file(file_id).deleted
        return content

    store.api_file_content = deleted_after_the_read
    try:
        with pytest.raises(NotFoundError, match=f"No such file: {upload.id}"):
            sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    finally:
        del store.api_file_content
    assert sdk.batches.list().data == []
    # a batch failed by the runner tells the client why, and keeps its finished lines
    store.save_api_file("file-2", "batch", "in.jsonl", _input(2))
    batch_id = create_batch(store, "file-2", "/v1/completions", "24h", None)["id"]
    job = store.job_by_key(batch_id)
    store.write_result(job.id, "l-0", prompt_tokens=3, output_token_ids=[7], status="done",
                       output_text=json.dumps({"status_code": 200, "body": {"n": 0}}))
    assert store.transition_job(job.id, "failed", ("queued",), error="RuntimeError: boom")
    failed = sdk.batches.retrieve(batch_id)
    assert failed.status == "failed" and failed.errors.data[0].message == "RuntimeError: boom"
    assert failed.output_file_id == f"{batch_id}-output"
    assert [json.loads(x)["custom_id"] for x in sdk.files.content(failed.output_file_id).text.splitlines()] == ["l-0"]
    assert not store.transition_job(job.id, "failed", ("queued",), error="again")  # a compare-and-set
    assert failed.failed_at is not None


def test_a_batch_cancelled_then_its_input_deleted_stays_cancelled(store):
    """The runner read a batch as queued, then found its input gone (the client had cancelled it and deleted the
    file in between) and stored it failed over the cancel."""
    store.save_api_file("file-c", "batch", "in.jsonl", _input(2))
    batch_id = create_batch(store, "file-c", "/v1/completions", "24h", None)["id"]
    runner = BatchRunner(store, _Engine(_Router(delay_s=0.01)), MODEL, log=lambda _: None)
    real = store.api_file_content

    def cancelled_and_deleted_meanwhile(file_id):
        store.update_job(store.job_by_key(batch_id).id, status="cancelled")
        assert store.delete_api_file(file_id).deleted
        return real(file_id)

    store.api_file_content = cancelled_and_deleted_meanwhile
    try:
        runner._step()
    finally:
        del store.api_file_content
    assert store.job_by_key(batch_id).status == "cancelled"


def test_a_batch_whose_input_was_deleted_as_it_was_created_fails_at_once_naming_it(store):
    store.save_api_file("file-gone", "batch", "in.jsonl", _input(2))
    batch_id = create_batch(store, "file-gone", "/v1/completions", "24h", None)["id"]
    store.update_job(store.job_by_key(batch_id).id, status="cancelled")  # out of the way of the delete ...
    assert store.delete_api_file("file-gone").deleted
    store.update_job(store.job_by_key(batch_id).id, status="queued")  # ... as a create racing the delete would be
    logged: list[str] = []
    engine = _Engine(_Router(delay_s=0.01))
    runner = BatchRunner(store, engine, MODEL, poll_s=0.01, log=logged.append)
    runner.start()
    try:
        wait_until(lambda: store.job_by_key(batch_id).status == "failed", timeout_s=30, what=f"failed ({logged})")
    finally:
        runner.stop()
    assert "input file file-gone is no longer stored (deleted)" in store.job_by_key(batch_id).error
    assert sum("failed" in line for line in logged) == 1


def test_prune_deletes_expired_files_but_keeps_those_a_running_batch_reads(store):
    now = time.time()
    store.save_api_file("file-old", "batch", "a.jsonl", _input(1), expires_at_s=now - 10)
    store.save_api_file("file-read", "batch", "b.jsonl", _input(2), expires_at_s=now + 60)
    store.save_api_file("file-new", "batch", "c.jsonl", _input(1), expires_at_s=now + 3600)
    store.save_api_file("file-kept", "batch", "d.jsonl", _input(1))  # uploaded before expiry existed
    batch_id = create_batch(store, "file-read", "/v1/completions", "24h", None)["id"]
    _expire(store, "file-read")  # it expires while its batch waits for a trough
    assert store.api_file_readers("file-read") == [batch_id]
    dry = store.prune_api_files(dry_run=True)
    assert (dry.files, dry.bytes, dry.kept, dry.dry_run) == (1, len(_input(1)), 1, True)
    assert store.api_file("file-old") is not None  # a dry run deletes nothing
    done = store.prune_api_files()
    assert (done.files, done.bytes, done.kept) == (dry.files, dry.bytes, dry.kept)
    assert "deleted 1 expired file(s)" in done.describe() and "1 expired file(s) kept" in done.describe()
    assert {i.id for i in store.list_api_files(10, now_s=now)[0]} == {"file-new", "file-kept"}
    assert store.api_file("file-old") is None and store.api_file_content("file-read") is not None
    store.update_job(store.job_by_key(batch_id).id, status="done")
    assert store.prune_api_files().files == 1 and store.api_file("file-read") is None
    assert store.prune_api_files(now_s=now + 7200).files == 1  # file-new, once its hour has passed
    assert [i.id for i in store.list_api_files(10)[0]] == ["file-kept"]
    with pytest.raises(InputError, match="after: no stored file"):
        store.list_api_files(10, after="file-old")


def test_store_prune_and_the_retention_job_delete_expired_files(tmp_path, monkeypatch, capsys):
    from flexpipe_dag.cli import main
    from flexpipe_dag.jobs.retention import store_retention
    from flexpipe_dag.resources.store_resource import StoreResource

    url = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("FLEXPIPE_DATABASE_URL", url)
    res = StoreResource(database_url=url)
    store = res.get_store()
    for i in range(3):
        store.save_api_file(f"file-{i}", "batch", "a.jsonl", _input(1), expires_at_s=time.time() - 1)
    assert main(["store", "prune", "--dry-run"]) == 0
    assert "uploaded files: would delete 3 expired file(s)" in capsys.readouterr().out
    assert main(["store", "prune"]) == 0
    printed = capsys.readouterr().out
    assert "uploaded files: deleted 3 expired file(s)" in printed and "batch results: deleted 0 row(s)" in printed
    store.save_api_file("file-9", "batch", "a.jsonl", _input(1), expires_at_s=time.time() - 1)
    run = store_retention.execute_in_process(resources={"store": res})
    assert run.success and run.output_for_node("prune_expired_files") == 1 and store.api_file("file-9") is None
    assert run.output_for_node("prune_expired_batch_results") == 0


def test_looking_at_a_store_that_is_not_there_makes_no_file(tmp_path, monkeypatch, capsys):
    """``store status`` and ``store prune --dry-run`` on a mistyped SQLite path made an empty database there."""
    from flexpipe_dag.cli import main

    path = tmp_path / "typo.db"
    monkeypatch.setenv("FLEXPIPE_DATABASE_URL", f"sqlite:///{path}")
    assert main(["store", "status"]) == 0 and "no database file at" in capsys.readouterr().out
    assert main(["store", "prune", "--dry-run"]) == 0 and "nothing to prune" in capsys.readouterr().out
    assert not path.exists()


def test_a_batchs_output_expires_as_asked_and_a_prune_deletes_its_rows_keeping_its_counts(sdk, store):
    """A batch's result rows stayed forever (a busy batch server writes gigabytes of them); its output and error
    files now expire as OpenAI's do (``output_expires_after``, 30 days by default) and a prune deletes the rows."""
    upload = sdk.files.create(file=("in.jsonl", _input(3)), purpose="batch")
    short = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h",
                               output_expires_after={"anchor": "created_at", "seconds": 3600})
    default = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    for batch in (short, default):
        job = store.job_by_key(batch.id)
        for n, status in enumerate(("done", "done", "failed")):
            store.write_result(job.id, f"l-{n}", prompt_tokens=3, output_token_ids=[7], status=status,
                               output_text=json.dumps({"status_code": 200 if status == "done" else 400, "body": {}}))
        sdk.batches.cancel(batch.id)  # ended: its files are written now and expire from now
    ended = time.time()
    output = sdk.files.retrieve(f"{short.id}-output")
    assert output.expires_at is not None and abs(output.expires_at - ended - 3600) <= 3
    assert abs(sdk.files.retrieve(f"{default.id}-errors").expires_at - ended - 30 * 86400) <= 3
    for seconds in (59, "3600", 30 * 86400 + 1):
        with pytest.raises(BadRequestError, match="output_expires_after.seconds"):
            sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h",
                               output_expires_after={"anchor": "created_at", "seconds": seconds})  # type: ignore
    dry = store.prune_batch_results(dry_run=True, now_s=ended + 3601)
    assert (dry.batches, dry.rows) == (1, 3) and len(store.results(store.job_by_key(short.id).id)) == 3
    done = store.prune_batch_results(now_s=ended + 3601)
    assert (done.batches, done.rows) == (1, 3) and "deleted 3 row(s) of 1 batch(es)" in done.describe()
    assert store.results(store.job_by_key(short.id).id) == [] and len(store.results(store.job_by_key(default.id).id)) == 3
    gone = sdk.batches.retrieve(short.id)  # the batch reads as before: its counts kept, its files gone
    assert gone.status == "cancelled" and (gone.request_counts.completed, gone.request_counts.failed) == (2, 1)
    for file_id in (gone.output_file_id, gone.error_file_id):
        with pytest.raises(NotFoundError):
            sdk.files.content(file_id)
    assert store.prune_batch_results(now_s=ended + 3601).batches == 0  # once
    assert store.prune_batch_results(now_s=ended + 30 * 86400 + 1).rows == 3  # the default batch's, a month later


def test_a_batchs_usage_sums_its_completed_lines_and_survives_the_prune(sdk, store):
    """OpenAI's batch object has ``usage`` (the tokens billed: its completed lines'); it was null. It is read with
    the counts, in one statement, and a prune keeps it as it keeps them."""
    upload = sdk.files.create(file=("in.jsonl", _input(3)), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.usage is not None and (batch.usage.input_tokens, batch.usage.output_tokens) == (0, 0)
    job = store.job_by_key(batch.id)
    for n, (status, prompt, out) in enumerate((("done", 3, [7, 8]), ("done", 5, [9]), ("failed", 4, []))):
        store.write_result(job.id, f"l-{n}", prompt_tokens=prompt, output_token_ids=out, status=status,
                           output_text=json.dumps({"status_code": 200 if status == "done" else 400, "body": {}}))
    sdk.batches.cancel(batch.id)
    usage = sdk.batches.retrieve(batch.id).usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (8, 3, 11)  # the failed line is not billed
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert store.prune_batch_results(now_s=time.time() + 31 * 86400).rows == 3
    after = sdk.batches.retrieve(batch.id)
    assert after.usage == usage and (after.request_counts.completed, after.request_counts.failed) == (2, 1)
    store.write_result(job.id, "late", prompt_tokens=2, output_token_ids=[1], status="done",
                       output_text=json.dumps({"status_code": 200, "body": {}}))  # a line that came after the prune
    assert sdk.batches.retrieve(batch.id).usage.total_tokens == 14
    store.prune_batch_results(now_s=time.time() + 31 * 86400)
    assert sdk.batches.retrieve(batch.id).usage.total_tokens == 14
    # a prune before the token sums were kept: the usage is not known (null), never an undercount
    from flexpipe_dag.core.status import API_BATCH_CONFIG_KEY

    spec = dict(job.config[API_BATCH_CONFIG_KEY], results_pruned={"completed": 2, "failed": 1, "at": 0})
    from sqlalchemy import update

    from flexpipe_dag.sql import models as m

    with store.session() as s:
        s.execute(update(m.InferenceJob).where(m.InferenceJob.id == job.id)
                  .values(config={**job.config, API_BATCH_CONFIG_KEY: spec}))
    old = sdk.batches.retrieve(batch.id)
    assert old.usage is None and old.request_counts.completed == 2


def _ended_batch(store, lines: int = 2, status: str = "done", after_s: int = 3600) -> str:
    """A Batch API batch of ``lines`` answered lines that has just ended with ``status``; its id."""
    from flexpipe_dag.serving.frontdoor.batches import results_expire_at

    store.save_api_file(f"file-{status}-{lines}", "batch", "in.jsonl", _input(lines))
    batch_id = create_batch(store, f"file-{status}-{lines}", "/v1/completions", "24h", None, after_s)["id"]
    job = store.job_by_key(batch_id)
    for n in range(lines):
        store.write_result(job.id, f"l-{n}", prompt_tokens=3, output_token_ids=[7], status="done",
                           output_text=json.dumps({"status_code": 200, "body": {}}))
    assert store.transition_job(job.id, status, ("queued",), results_expire_at=results_expire_at(job))
    return batch_id


def test_a_prune_keeps_the_batchs_end_time_and_counts_a_line_that_came_after_it(store):
    """The prune rewrote the job (its ``updated_at``): ``completed_at`` moved to the prune's time. A line that came
    after a prune (an owner still finishing it) was never counted nor pruned."""
    from flexpipe_dag.serving.frontdoor.batches import batch_object

    batch_id = _ended_batch(store, lines=2, status="cancelled")
    before = batch_object(store, store.job_by_key(batch_id), None)
    time.sleep(1.1)
    assert store.prune_batch_results(now_s=time.time() + 3601).rows == 2
    job = store.job_by_key(batch_id)
    after = batch_object(store, job, None)
    assert after["cancelled_at"] == before["cancelled_at"] and after["request_counts"] == before["request_counts"]
    store.write_result(job.id, "late", prompt_tokens=3, output_token_ids=[7], status="failed",
                       output_text=json.dumps({"status_code": 400, "body": {}}))
    assert batch_object(store, job, None)["request_counts"] == {"total": 2, "completed": 2, "failed": 1}
    assert store.prune_batch_results(now_s=time.time() + 3601).rows == 1  # the late line, counted and pruned
    assert batch_object(store, store.job_by_key(batch_id), None)["request_counts"]["failed"] == 1
    assert store.prune_batch_results(now_s=time.time() + 3601).batches == 0


def test_the_prune_never_takes_the_rows_of_a_batch_that_has_not_ended(store):
    """A batch whose cancel was overwritten by a writer that had read it before (now a compare-and-set) kept the
    cancel's expiry while it ran on; the prune took its rows mid-run."""
    batch_id = _ended_batch(store, lines=2, status="cancelled")
    store.update_job(store.job_by_key(batch_id).id, status="running")  # as the lost cancel left it
    assert store.prune_batch_results(now_s=time.time() + 7200).rows == 0
    assert len(store.results(store.job_by_key(batch_id).id)) == 2


def test_a_cancel_written_while_the_runner_parsed_the_input_is_not_overwritten(store):
    store.save_api_file("file-p", "batch", "in.jsonl", _input(2))
    batch_id = create_batch(store, "file-p", "/v1/completions", "24h", None)["id"]
    engine = _Engine(_Router(delay_s=0.01))
    runner = BatchRunner(store, engine, MODEL, log=lambda _: None)
    real = runner._job_lines

    def cancelled_while_parsing(job):
        lines = real(job)
        store.transition_job(job.id, "cancelled", ("queued",))
        return lines

    runner._job_lines = cancelled_while_parsing
    runner._step()
    assert store.job_by_key(batch_id).status == "cancelled" and engine.router.seen == []


def test_a_failed_batchs_files_wait_for_its_lines_in_flight(store):
    from types import SimpleNamespace

    from flexpipe_dag.serving.frontdoor.batches import batch_file, batch_object

    store.heartbeat_pipeline_run("fd-a", "serve", "g")
    batch_id = _ended_batch(store, lines=1, status="failed")
    job = store.job_by_key(batch_id)
    assert store.claim_batch(job.id, "fd-a", None) is False  # failed: not claimed now; as if it were owned before
    from sqlalchemy import update

    from flexpipe_dag.sql import models as m

    with store.session() as s:
        s.execute(update(m.InferenceJob).where(m.InferenceJob.id == job.id).values(owner_run_key="fd-a"))
    elsewhere = SimpleNamespace(inflight=lambda job_id: 0, run_key="fd-b")
    job = store.job_by_key(batch_id)
    assert batch_object(store, job, elsewhere)["output_file_id"] is None  # fd-a may still write lines
    assert batch_file(store, f"{batch_id}-output", elsewhere) is None
    owner = BatchRunner(store, _Engine(_Router(delay_s=0.01)), MODEL, log=lambda _: None, run_key="fd-a")
    owner._step()  # nothing in flight on fd-a: released
    job = store.job_by_key(batch_id)
    assert job.owner_run_key is None and batch_object(store, job, elsewhere)["output_file_id"] == f"{batch_id}-output"


def test_batches_that_ended_before_the_upgrade_expire_30_days_after_their_last_update(store):
    from flexpipe_dag.sql.store import downgrade, migrate

    store.save_api_file("file-old", "batch", "in.jsonl", _input(1))
    batch_id = create_batch(store, "file-old", "/v1/completions", "24h", None)["id"]
    store.update_job(store.job_by_key(batch_id).id, status="done")  # ended before 0016 knew the expiry
    store.get_or_create_job("dagster-batch", "batch")  # not a Batch API batch: never dated
    store.update_job(store.job_by_key("dagster-batch").id, status="done")
    downgrade(store.engine, "0015")
    migrate(store.engine)
    from flexpipe_dag.core.clock import as_utc

    job = store.job_by_key(batch_id)
    assert abs((as_utc(job.results_expire_at) - as_utc(job.updated_at)).total_seconds() - 30 * 86400) < 1
    assert store.job_by_key("dagster-batch").results_expire_at is None


def test_a_batch_paused_or_cancelled_while_running_gets_no_more_lines(store):
    """A batch the runner had read as running was served on from that snapshot after a cancel or a pause."""
    store.save_api_file("file-r", "batch", "in.jsonl", _input(6))
    batch_id = create_batch(store, "file-r", "/v1/completions", "24h", None)["id"]
    engine = _Engine(_Router(delay_s=0.01))
    runner = BatchRunner(store, engine, MODEL, max_inflight=2, log=lambda _: None)
    engine.router.on_result = runner.on_result
    runner._step()  # queued -> running, 2 lines submitted
    wait_until(lambda: len(store.results(store.job_by_key(batch_id).id)) == 2, timeout_s=10, what="2 rows")
    real = runner._job_lines

    def paused_meanwhile(job):
        lines = real(job)
        assert store.transition_job(job.id, "paused", ("running",))
        return lines

    runner._job_lines = paused_meanwhile
    runner._step()
    assert len(engine.router.seen) == 2 and store.job_by_key(batch_id).status == "paused"


def test_a_body_that_cannot_be_parsed_and_a_long_cursor_get_short_errors(store):
    app = create_app(_Engine(_Router(delay_s=0.01)), MODEL, batch_api=BatchAPI(store))
    with TestClient(app) as http:
        deep = "[" * 5000 + "]" * 5000
        answer = http.post("/v1/batches", content=deep, headers={"content-type": "application/json"})
        assert answer.status_code == 400 and "could not be parsed" in answer.json()["error"]["message"], answer.text
        answer = http.get("/v1/batches", params={"after": "x" * 10_000})
        assert answer.status_code == 400 and len(answer.json()["error"]["message"]) < 200
        answer = http.post("/v1/files", data={"purpose": "batch", "expires_after": '{"seconds": 60}'},
                           files=[("file", ("a.jsonl", _input(1), "application/jsonl"))])
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "expires_after"


def test_reading_a_batch_file_and_storing_an_upload_run_off_the_event_loop(sdk, monkeypatch):
    """A 300,000-line input checked on the event loop stalled every stream and health check for 3.4 s (a helper's
    attack): the parse and the store's reads and writes of whole files run on worker threads."""
    import asyncio

    import flexpipe_dag.serving.frontdoor.app as app_module
    from flexpipe_dag.sql.store import Store

    on_loop: dict[str, bool] = {}

    def recorded(name, fn):
        def run(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                on_loop[name] = True
            except RuntimeError:  # no loop runs in this thread: a worker thread
                on_loop[name] = False
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(app_module, "create_batch", recorded("create_batch", app_module.create_batch))
    monkeypatch.setattr(Store, "save_api_file", recorded("save_api_file", Store.save_api_file))
    monkeypatch.setattr(Store, "api_file_content", recorded("api_file_content", Store.api_file_content))
    uploaded = sdk.files.create(file=("in.jsonl", _input(3)), purpose="batch")
    assert sdk.files.content(uploaded.id).content == _input(3)
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.request_counts.total == 3
    assert on_loop == {"create_batch": False, "save_api_file": False, "api_file_content": False}
