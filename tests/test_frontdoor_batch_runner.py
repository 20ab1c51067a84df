"""The Batch API runner against a real store, with a router that answers from another thread.

The router here is a fake beside the real :class:`~flexpipe_dag.shift.router.ServingRouter` (which the
server tests drive): like the real one it refuses a request id it has seen and calls ``on_result``
from a pump thread. The store is the real SQL store, slowed down where a row is written, so the
window between a line's result and its row is wide open.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.runtime.scheduler import RequestOutput
from flexpipe_dag.serving.frontdoor.batches import BatchRunner, create_batch
from flexpipe_dag.serving.frontdoor.engine import FrontDoorEngine
from flexpipe_dag.serving.frontdoor.metrics import FrontDoorMetrics
from tests.support import wait_until

MODEL = "m"
#: the pipeline a fake router serves on (``router.active``): its gear is what a result row names
ACTIVE = SimpleNamespace(gear=SimpleNamespace(gear_id="throughput-2s"))


class _Tokenizer:
    def __len__(self) -> int:
        return 1000

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(str(i) for i in ids)


class _Router:
    """Refuses an id it has seen (as ServingRouter's ledger does); answers each request after ``delay_s``."""

    active = ACTIVE

    def __init__(self, delay_s: float):
        self.delay_s, self.seen, self.on_result = delay_s, [], None

    def submit(self, requests) -> None:
        for r in requests:
            if r.request_id in self.seen:
                raise InputError("request", "request_id", f"{r.request_id!r} was submitted before")
            self.seen.append(r.request_id)
            threading.Timer(self.delay_s, self._answer, (r,)).start()

    def _answer(self, r) -> None:
        now = time.monotonic()
        self.on_result(RequestOutput(r.request_id, list(r.prompt_token_ids), [7, 8, 9], "length", now, now, now))


class _Engine:
    """What the runner reads of a :class:`FrontDoorEngine`."""

    check_context = FrontDoorEngine.check_context

    def __init__(self, router: _Router):
        self.router, self.draining, self.pending = router, False, 0
        self.tokenizer, self.metrics, self.eos_token_ids = _Tokenizer(), FrontDoorMetrics(), [0]
        self.max_context_tokens = self.served_limit_tokens = 2048
        self.default_max_tokens, self.fair_share_tokens = 0, None


class _SlowWrites:
    """The real store, each result row written ``delay_s`` late; the first ``fail`` writes raise."""

    def __init__(self, store, delay_s: float, fail: int = 0):
        self._store, self.delay_s, self.fail = store, delay_s, fail

    def __getattr__(self, name):
        return getattr(self._store, name)

    def write_result(self, *args, **kwargs):
        time.sleep(self.delay_s)
        if self.fail > 0:
            self.fail -= 1
            raise OSError("disk I/O error (injected)")
        return self._store.write_result(*args, **kwargs)


def _batch(store, n: int) -> str:
    lines = [{"custom_id": f"l-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": [1, 2, 3 + i], "max_tokens": 3, "temperature": 0}} for i in range(n)]
    store.save_api_file("file-1", "batch", "b.jsonl", "\n".join(json.dumps(x) for x in lines).encode())
    return create_batch(store, "file-1", "/v1/completions", "24h", None)["id"]


def _run(store, slow, n: int, engine: _Engine | None = None) -> tuple[_Router, object, list[str]]:
    """Serve a batch of ``n`` lines through ``slow`` (the store, or a :class:`_SlowWrites` over it) to completion:
    the router, the job, the log."""
    batch_id = _batch(store, n)
    engine = engine or _Engine(_Router(delay_s=0.01))
    logged: list[str] = []
    runner = BatchRunner(slow, engine, MODEL, max_inflight=3, poll_s=0.01, log=logged.append)
    engine.router.on_result = runner.on_result
    return engine.router, _serve_until_done(store, runner, batch_id, logged), logged


def _serve_until_done(store, runner: BatchRunner, batch_id: str, logged: list[str]):
    """Run ``runner`` until batch ``batch_id`` is done; its job row."""
    runner.start()
    try:
        wait_until(lambda: next(j for j in store.jobs(kind="batch") if j.job_key == batch_id).status == "done",
                   timeout_s=60, what=f"batch {batch_id} done ({logged})")
    finally:
        runner.stop()
    return next(j for j in store.jobs(kind="batch") if j.job_key == batch_id)


def test_a_line_whose_row_is_being_written_is_not_served_again(store):
    """The runner steps every 10 ms while each row takes 200 ms to write: a line stays in flight until its
    row exists, so each line goes to the pipeline once and the batch completes (before, a step in that
    window re-submitted the line under the same id, the router refused it, and the batch never ended)."""
    router, job, logged = _run(store, _SlowWrites(store, delay_s=0.2), n=8)
    lines = sorted(rid.rsplit(":", 1)[0] for rid in router.seen)
    assert lines == sorted(f"batch:{job.id}:{i}" for i in range(8)), router.seen  # each line submitted once
    assert len(store.results(job.id)) == 8 and not logged[:-1], logged


def test_a_row_that_cannot_be_written_is_served_again_under_a_fresh_id(store):
    router, job, logged = _run(store, _SlowWrites(store, delay_s=0.0, fail=2), n=4)
    assert len(router.seen) == len(set(router.seen)) == 6  # two lines served twice, each time a new id
    assert sorted(r.request_key for r in store.results(job.id)) == [f"l-{i}" for i in range(4)]
    assert {r.gear_key for r in store.results(job.id)} == {"throughput-2s"}  # the gear that served each line
    assert sum("was not stored (OSError: disk I/O error (injected)); the line is served again" in x
               for x in logged) == 2, logged


class _StreamingRouter:
    """Samples tokens 7, 8, 9, ... one at a time from a pump thread (``on_token``), then the result unless the
    request was cancelled first (as ServingRouter delivers no cancelled request)."""

    active = ACTIVE

    def __init__(self, tokens: int):
        self.tokens, self.cancelled, self.sent = tokens, [], {}
        self.on_result = self.on_token = None

    def submit(self, requests) -> None:
        for r in requests:
            threading.Thread(target=self._stream, args=(r,), daemon=True).start()

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True

    def _stream(self, r) -> None:
        out = []
        for i in range(min(self.tokens, r.max_new_tokens)):
            if r.request_id in self.cancelled:
                self.sent[r.request_id] = len(out)
                return
            out.append(7 + i)
            self.on_token(r.request_id, i, 7 + i)
            time.sleep(0.01)
        self.sent[r.request_id] = len(out)
        now = time.monotonic()
        self.on_result(RequestOutput(r.request_id, list(r.prompt_token_ids), out, "length", now, now, now))


def _stop_batch(store) -> tuple[_StreamingRouter, object, dict[str, dict], list[str]]:
    """A batch of a line with stop ``9`` and one without, served on a :class:`_StreamingRouter` of 60 tokens:
    the router, the job, the rows' bodies by custom id, the runner's log."""
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 200, "temperature": 0, **extra}}
             for cid, extra in (("stops", {"stop": ["9"]}), ("runs", {}))]
    store.save_api_file("file-1", "batch", "b.jsonl", "\n".join(json.dumps(x) for x in lines).encode())
    batch_id = create_batch(store, "file-1", "/v1/completions", "24h", None)["id"]
    router = _StreamingRouter(tokens=60)
    logged: list[str] = []
    runner = BatchRunner(store, _Engine(router), MODEL, poll_s=0.01, log=logged.append)
    router.on_result, router.on_token = runner.on_result, runner.on_token
    job = _serve_until_done(store, runner, batch_id, logged)
    wait_until(lambda: len(router.sent) == 2, timeout_s=10, what="both generations ended")
    assert len(store.results(job.id)) == 2
    return router, job, {r.request_key: json.loads(r.output_text)["body"] for r in store.results(job.id)}, logged


def test_a_batch_line_with_a_stop_sequence_is_answered_at_it_and_cancelled_in_the_pipeline(store):
    """A line's stop sequence ends its row at the token that completes it (finish ``stop``, the tokens through
    it counted) and cancels the rest of its generation, as the endpoint's stream does; a line without one runs
    to its result. Before, every line ran to max_tokens and was cut afterwards."""
    router, job, rows, _ = _stop_batch(store)
    stopped, ran = rows["stops"], rows["runs"]
    assert stopped["choices"][0]["text"] == "7 8 " and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 3
    assert ran["choices"][0]["finish_reason"] == "length" and ran["usage"]["completion_tokens"] == 60
    [cancelled] = router.cancelled
    assert cancelled.startswith(f"batch:{job.id}:0:") and router.sent[cancelled] < 60  # cut short, not run out
    assert not any(rid.startswith(f"batch:{job.id}:1:") for rid in router.cancelled)


def test_a_stop_watch_that_raises_leaves_the_line_to_its_whole_result_and_the_pipeline_serving(store, monkeypatch):
    """Token checks run on the pipeline's pump thread: one that raises (a tokenizer's error) must not reach it.
    The line is then cut at its stop from its whole result, as before the watch existed."""
    from flexpipe_dag.serving.frontdoor import batches

    def broken(self, index, token_id):
        raise ValueError("token id out of the vocabulary")

    monkeypatch.setattr(batches._StopWatch, "add", broken)
    router, job, rows, logged = _stop_batch(store)
    stopped = rows["stops"]
    assert stopped["choices"][0]["text"] == "7 8 " and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 3 and router.cancelled == [] and set(router.sent.values()) == {60}
    assert sum("stop sequences are checked at its end (ValueError: token id out of" in x for x in logged) == 1, logged
    # the row holds the tokens the response counts (it held all 60), so the batch's usage is the responses' sum
    from flexpipe_dag.serving.frontdoor.batches import batch_object

    assert {r.request_key: r.output_tokens for r in store.results(job.id)} == {"stops": 3, "runs": 60}
    assert batch_object(store, store.job_by_key(job.job_key), None)["usage"] == {
        "input_tokens": 6, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 63,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 69}


def test_a_line_whose_answer_raises_before_its_row_is_served_again(store):
    """An answer that raises before its row is written (here the decode) takes the line out of flight: it is
    served again under a fresh id and the batch completes, not left waiting for a result that never comes."""
    class FlakyTokenizer(_Tokenizer):
        failed = False

        def decode(self, ids, skip_special_tokens=True) -> str:
            if not FlakyTokenizer.failed:
                FlakyTokenizer.failed = True
                raise RuntimeError("decoder hiccup")
            return super().decode(ids, skip_special_tokens)

    engine = _Engine(_Router(delay_s=0.01))
    engine.tokenizer = FlakyTokenizer()
    router, job, logged = _run(store, store, 3, engine)
    assert sorted(r.request_key for r in store.results(job.id)) == ["l-0", "l-1", "l-2"] and len(router.seen) == 4
    assert sum("was not stored (RuntimeError: decoder hiccup); the line is served again" in x for x in logged) == 1


def test_a_batch_file_is_dated_when_the_batch_ended_and_not_read_while_lines_are_in_flight(store):
    """A generated output file's ``created_at`` is the batch's end, the same at every read (before, the time
    of the read); while a cancelled batch still has lines in flight ("cancelling") its files are not there
    yet (before, an empty file was, and the same id later held the finished lines)."""
    from types import SimpleNamespace

    from flexpipe_dag.serving.frontdoor.batches import batch_file, batch_object

    router, job, logged = _run(store, store, n=3)
    first, again = batch_file(store, f"{job.job_key}-output"), batch_file(store, f"{job.job_key}-output")
    assert first is not None and first == again and len(first.content.splitlines()) == 3
    assert first.created_at == batch_object(store, job, None)["completed_at"] == int(job.updated_at.timestamp())
    assert batch_file(store, f"{job.job_key}-errors") is None  # no error line: no error file (none is named)
    store.update_job(job.id, status="cancelled")  # as a cancel while lines are still on the pipeline
    job = next(j for j in store.jobs(kind="batch") if j.id == job.id)
    busy = SimpleNamespace(inflight=lambda job_id: 2)
    assert batch_object(store, job, busy)["status"] == "cancelling"
    assert batch_file(store, f"{job.job_key}-output", busy) is None
    assert batch_file(store, f"{job.job_key}-output", SimpleNamespace(inflight=lambda job_id: 0)) is not None


def test_servers_sharing_a_store_serve_each_batch_once_and_take_over_an_ended_ones(store):
    """Several servers on one store each served every batch (each line written once, the compute spent twice). A
    batch is now claimed by one server (``inference_jobs.owner_run_key``, an atomic compare-and-set), and taken
    over by another once its owner has ended."""
    for run_key in ("fd-a", "fd-b", "fd-c"):
        store.heartbeat_pipeline_run(run_key, "serve", "throughput-2s")
    logs: dict[str, list[str]] = {"fd-a": [], "fd-b": []}
    engines = {rk: _Engine(_Router(delay_s=0.01)) for rk in logs}
    runners = {rk: BatchRunner(store, engines[rk], MODEL, max_inflight=3, poll_s=0.01, log=logs[rk].append,
                               run_key=rk) for rk in logs}
    for rk, runner in runners.items():
        engines[rk].router.on_result = runner.on_result
        runner.start()

    def job_of(batch_id):
        return next(j for j in store.jobs(kind="batch") if j.job_key == batch_id)

    try:
        first = _batch(store, 8)
        wait_until(lambda: job_of(first).status == "done", timeout_s=60, what=f"batch {first} done ({logs})")
        owner = job_of(first).owner_run_key
        other = "fd-b" if owner == "fd-a" else "fd-a"
        assert owner in logs and len(engines[owner].router.seen) == 8 and engines[other].router.seen == []
        assert sum(f"batch {first}: served here" in x for x in logs[owner] + logs[other]) == 1
        # a batch whose owner ended is taken over by one of the live servers
        store.save_api_file("file-2", "batch", "c.jsonl", b"\n".join(json.dumps(
            {"custom_id": f"m-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": MODEL, "prompt": [1, 2], "max_tokens": 3}}).encode() for i in range(4)))
        for runner in runners.values():
            runner.stop()
        second = create_batch(store, "file-2", "/v1/completions", "24h", None)["id"]
        assert store.claim_batch(job_of(second).id, "fd-c", None) and not store.claim_batch(job_of(second).id,
                                                                                              "fd-a", None)
        store.end_pipeline_run("fd-c")
        runner = BatchRunner(store, engines["fd-b"], MODEL, poll_s=0.01, log=logs["fd-b"].append, run_key="fd-b")
        engines["fd-b"].router.on_result = runner.on_result
        runner.start()
        try:
            wait_until(lambda: job_of(second).status == "done", timeout_s=60, what=f"batch {second} done ({logs})")
        finally:
            runner.stop()
        assert job_of(second).owner_run_key == "fd-b"
        assert f"batch {second}: served here, taken over from run fd-c (it ended)" in logs["fd-b"]
        assert sorted(r.request_key for r in store.results(job_of(second).id)) == [f"m-{i}" for i in range(4)]
    finally:
        for runner in runners.values():
            runner.stop()


def test_a_cancelled_batch_reads_cancelling_on_every_server_until_its_owner_has_released_it(store):
    """Seen: a server that did not own a cancelled batch said ``cancelled`` at once and served its files while the
    owner still had lines in flight (the same file id later held more rows). The owner now releases the batch
    once its last line in flight has finished; until then every server reads it ``cancelling``."""
    from flexpipe_dag.serving.frontdoor.batches import batch_file, batch_object

    for run_key in ("fd-a", "fd-b"):
        store.heartbeat_pipeline_run(run_key, "serve", "throughput-2s")
    batch_id = _batch(store, 3)

    def job():
        return next(j for j in store.jobs(kind="batch") if j.job_key == batch_id)

    assert store.claim_batch(job().id, "fd-a", None)
    store.update_job(job().id, status="cancelled")  # fd-a has lines in flight (it has not released the batch)
    elsewhere = SimpleNamespace(inflight=lambda job_id: 0, run_key="fd-b")
    assert batch_object(store, job(), elsewhere)["status"] == "cancelling"
    assert batch_file(store, f"{batch_id}-output", elsewhere) is None
    assert not store.release_batch(job().id, "fd-b")  # only the owner releases it
    store.write_result(job().id, "l-0", prompt_tokens=3, output_token_ids=[7], status="done",  # fd-a's last line
                       output_text=json.dumps({"status_code": 200, "body": {}}))
    owner = BatchRunner(store, _Engine(_Router(delay_s=0.01)), MODEL, poll_s=0.01, log=(logged := []).append,
                        run_key="fd-a")
    owner._step()  # nothing of the batch in flight on fd-a: released
    assert job().owner_run_key is None
    assert f"batch {batch_id}: cancelled, no line of it in flight here any more: released" in logged
    assert batch_object(store, job(), elsewhere)["status"] == "cancelled"
    assert batch_file(store, f"{batch_id}-output", elsewhere) is not None
    assert not store.claim_batch(job().id, "fd-b", None)  # released, but cancelled: nobody serves it again
    # an owner that ended sends nothing more: its lines in flight have no row, the batch reads cancelled at once
    second = create_batch(store, "file-1", "/v1/completions", "24h", None)["id"]  # the same input again
    second_id = next(j for j in store.jobs(kind="batch") if j.job_key == second).id
    assert store.claim_batch(second_id, "fd-a", None)
    store.update_job(second_id, status="cancelled")
    assert batch_object(store, store.jobs(kind="batch")[-1], elsewhere)["status"] == "cancelling"
    store.end_pipeline_run("fd-a")
    assert batch_object(store, store.jobs(kind="batch")[-1], elsewhere)["status"] == "cancelled"


def test_a_completed_batch_is_read_whole_on_every_server_while_its_owner_is_live(store):
    """A completed batch keeps its owner; another server serves its files (all its rows are written)."""
    from flexpipe_dag.serving.frontdoor.batches import batch_file, batch_object

    store.heartbeat_pipeline_run("fd-a", "serve", "throughput-2s")
    router, job, logged = _run(store, store, n=3)
    assert store.claim_batch(job.id, "fd-a", None) is False  # done: not claimed now
    # as if fd-a had claimed it while it ran
    with store.session() as s:
        s.get(type(job), job.id).owner_run_key = "fd-a"
    job = next(j for j in store.jobs(kind="batch") if j.id == job.id)
    elsewhere = SimpleNamespace(inflight=lambda job_id: 0, run_key="fd-b")
    assert batch_object(store, job, elsewhere)["status"] == "completed"
    output = batch_file(store, f"{job.job_key}-output", elsewhere)
    assert output is not None and len(output.content.splitlines()) == 3
    assert batch_file(store, f"{job.job_key}-output", None) == output


def test_a_server_forgets_the_lines_of_the_batches_it_no_longer_serves(store):
    """The runner kept every batch's parsed lines and finished ids for the server's life (up to 64 MiB of input
    each, for weeks); it now keeps only the runnable batches' and those with lines in flight."""
    batch_id = _batch(store, 3)
    engine, logged = _Engine(_Router(delay_s=0.01)), []
    runner = BatchRunner(store, engine, MODEL, max_inflight=3, poll_s=0.01, log=logged.append)
    engine.router.on_result = runner.on_result
    runner.start()
    try:
        wait_until(lambda: store.job_by_key(batch_id).status == "done", timeout_s=60, what=f"done ({logged})")
        wait_until(lambda: not runner._lines and not runner._finished, timeout_s=10, what="caches emptied")
        store.update_job(store.job_by_key(batch_id).id, status="queued")  # runnable again: read afresh from the store
        wait_until(lambda: store.job_by_key(batch_id).status == "done", timeout_s=60, what=f"done again ({logged})")
    finally:
        runner.stop()
    assert len(store.results(store.job_by_key(batch_id).id)) == 3 and len(engine.router.seen) == 3  # none twice
