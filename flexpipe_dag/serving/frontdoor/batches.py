"""OpenAI's Batch API on the live pipeline: a batch is an ``inference_jobs`` row, each line a result row.

* ``POST /v1/files`` stores the JSONL input in the store (:class:`~flexpipe_dag.sql.api_files.ApiFiles`).
* ``POST /v1/batches`` checks every line (``custom_id`` unique, ``method`` POST, ``url`` the batch's
  endpoint, ``body`` an object) and refuses the whole file with the line and field named when one is
  wrong, writing nothing; else it stores a batch job (status ``queued``; its config names the input
  file and endpoint under :data:`API_BATCH_KEY`).
* :class:`BatchRunner` (a thread of the server) serves the lines of every runnable batch (queued,
  admitted, running) at offline priority, at most ``max_inflight`` at a time and none while more than
  ``pause_above_online`` online requests are open, so online traffic is admitted first. The tide
  sensor pauses a running batch on a rise (status ``paused``: nothing more is submitted) and admits it
  again in a trough. Each finished line is written once (``request_results``, unique per line), so a
  server restarted mid-batch resumes where it stopped, and a line's response is exactly what the
  endpoint answers for the same body. A line the endpoint would refuse (context too long, a field
  FlexPipe does not serve) goes to the error file with its status code. A line with ``stop`` sequences
  is watched token by token as the endpoint's stream is: its row is written at the token that completes
  one, and the rest of its generation is cancelled in the pipeline (not run to ``max_tokens``). A line
  whose tokens did not all come (streamed tokens are not replayed after a reconfigure) is cut at its
  stop from its whole result, as before.
* ``POST /v1/batches/{id}/cancel`` sets ``cancelled``: nothing more is submitted; lines in flight
  finish and are kept (the batch reads ``cancelling`` until they have, on every server of the store: the
  owner releases the batch once its last line in flight has finished).
* A batch not ended when its completion window (24 h, OpenAI's only one) passes is ``expired`` by the first
  server's runner to see it: its finished lines are kept, every other line (those in flight too: they are
  cancelled in the pipeline) is answered ``batch_expired`` in the error file, in one transaction
  (:meth:`Store.expire_batch`), as OpenAI's expired batches are.
* The output and error files (``<batch id>-output``, ``<batch id>-errors``) are built from the result
  rows when read, in input order.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from flexpipe_dag.core.clock import epoch_s
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.ids import printable_problem
from flexpipe_dag.core.status import (
    API_BATCH_CONFIG_KEY,
    ENDED_JOB_STATUSES,
    RUNNABLE_JOB_STATUSES,
    UNFINISHED_JOB_STATUSES,
    InferenceJobKind,
    InferenceJobStatus,
    RequestResultStatus,
)
from flexpipe_dag.core.user_yaml import load_user_json
from flexpipe_dag.runtime.scheduler import PRIORITY_OFFLINE, Request, RequestOutput
from flexpipe_dag.serving.frontdoor.engine import (
    FrontDoorEngine,
    IncrementalDetokenizer,
    _first_stop,
    tokens_through_stop,
)
from flexpipe_dag.serving.frontdoor.prepare import chat_generation, completion_generation
from flexpipe_dag.serving.frontdoor.protocol import (
    DEFAULT_BATCH_FILE_EXPIRY_S,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    field_path,
    refuse_lone_surrogates,
)
from flexpipe_dag.serving.frontdoor.responses import chat_shapes, completion_shapes, list_object

API_BATCH_KEY = API_BATCH_CONFIG_KEY
#: Endpoints a batch may target.
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
#: Request ids of batch lines on the router: ``batch:<job id>:<line index>:<submission>``.
BATCH_PREFIX = "batch:"
RUNNABLE = RUNNABLE_JOB_STATUSES
#: Ended statuses whose last lines may still be in flight on their owner (it releases the batch once they are done).
LINES_MAY_TRAIL = (InferenceJobStatus.CANCELLED.value, InferenceJobStatus.FAILED.value)
#: The completion windows a batch may ask for (OpenAI's only one), seconds.
COMPLETION_WINDOWS_S = {"24h": 24 * 3600}
#: Seconds between two looks for batches whose completion window has passed (a 24-h window needs no finer clock; the
#: runner's poll, every half second, stays one read of the runnable batches).
EXPIRY_CHECK_S = 5.0
#: The error of a line an expired batch never served (OpenAI's ``batch_expired`` error-file line: no response).
BATCH_EXPIRED_ERROR = {"code": "batch_expired",
                       "message": "This request could not be executed before the completion window expired."}
#: Steps in a row that may raise for one batch before it is failed (its finished lines kept).
MAX_JOB_ERRORS = 5
#: A batch's owner (``inference_jobs.owner_run_key``) whose last heartbeat is older than this (seconds) has fallen
#: silent: another server takes the batch over (a server heartbeats every ``control_interval_s``, 2 s; 30 s is the
#: age at which ``flexpipe servers`` stops listing a run).
BATCH_OWNER_SILENT_S = 30.0


def owner_gone(store, owner: str) -> str | None:
    """Why the serving run ``owner`` of a batch serves it no more (it ended, or sent no heartbeat for
    :data:`BATCH_OWNER_SILENT_S`), or None while it is live."""
    live = store.pipeline_liveness(owner)
    if live.ended_at_s is not None:
        return "it ended"
    if live.heartbeat_at_s is None or time.time() - live.heartbeat_at_s > BATCH_OWNER_SILENT_S:
        return f"no heartbeat for over {BATCH_OWNER_SILENT_S:g} s"
    return None


def is_api_batch(job) -> bool:
    """Whether an inference job is a Batch API batch."""
    return isinstance(job.config, dict) and API_BATCH_KEY in job.config


class BatchInputGone(Exception):
    """A batch's input file is no longer in the store: the batch fails at once (a retry cannot bring it back)."""


@dataclass(frozen=True)
class BatchLine:
    """One line of a batch input file (0-based ``index`` in the file)."""

    index: int
    custom_id: str
    body: dict[str, Any]


def parse_batch_input(content: bytes, endpoint: str, file_id: str) -> list[BatchLine]:
    """The lines of a batch input file.

    Raises:
        APIError: 400 naming the file, the line (1-based) and the field: not UTF-8, not JSON, not an
            object, a string that is not Unicode text (a lone surrogate), a missing or repeated
            ``custom_id``, a ``method`` other than POST, a ``url`` other
            than ``endpoint``, a ``body`` that is not an object; or no line at all.
    """
    try:
        text = content.decode("utf-8-sig")  # a leading byte-order mark (Windows tools write one) is not a line's
    except UnicodeDecodeError as exc:
        line = content.count(b"\n", 0, exc.start) + 1
        raise APIError(400, f"file {file_id} line {line}: not UTF-8 text (byte {exc.start} of the file)",
                       param="input_file_id") from None
    lines: list[BatchLine] = []
    seen: set[str] = set()
    # "\n" only: str.splitlines() also splits at U+2028 / U+2029 / U+0085, legal inside a JSON string
    for n, raw in enumerate(text.split("\n"), start=1):
        raw = raw.removesuffix("\r")
        if not raw.strip():
            continue
        where = f"file {file_id} line {n}"
        try:
            row = load_user_json(raw, where)  # a repeated key is refused: which value was meant is not known
        except InputError as exc:
            raise APIError(400, f"{where}: {exc.problem}", param="input_file_id") from None
        if not isinstance(row, dict):
            raise APIError(400, f"{where}: expected a JSON object", param="input_file_id")
        refuse_lone_surrogates(row, f"{where}: ", param="input_file_id")
        cid = row.get("custom_id")
        if not isinstance(cid, str) or not cid or len(cid) > 200:
            raise APIError(400, f"{where}: custom_id: expected a string of 1-200 characters", param="input_file_id")
        problem = printable_problem(cid)  # it is echoed in the output file, the store and terminals
        if problem:
            raise APIError(400, f"{where}: custom_id: {problem}", param="input_file_id")
        if cid in seen:
            raise APIError(400, f"{where}: custom_id {cid!r} is repeated; each line needs its own",
                           param="input_file_id")
        seen.add(cid)
        if row.get("method", "POST") != "POST":
            raise APIError(400, f"{where}: method: expected POST, got {row.get('method')!r}", param="input_file_id")
        if row.get("url") != endpoint:
            raise APIError(400, f"{where}: url: expected {endpoint} (the batch's endpoint), got {row.get('url')!r}",
                           param="input_file_id")
        if not isinstance(row.get("body"), dict):
            raise APIError(400, f"{where}: body: expected a JSON object (the request body)", param="input_file_id")
        lines.append(BatchLine(len(lines), cid, row["body"]))
    if not lines:
        raise APIError(400, f"file {file_id}: no request lines", param="input_file_id")
    return lines


@dataclass
class _StopWatch:
    """A batch line with stop sequences, read as its tokens come (pump threads, under the runner's lock)."""

    stops: tuple[str, ...]
    prompt_tokens: int
    detok: IncrementalDetokenizer
    tokens: list[int]
    checked: int = 0  # characters of text already searched
    first_token_s: float | None = None

    def add(self, index: int, token_id: int) -> int | None:
        """Take the token at ``index`` (one seen before, after a move to another lane, is skipped); the
        stop's start in the text when a stop sequence is now complete, else None."""
        if index != len(self.tokens):
            return None
        self.tokens.append(token_id)
        if self.first_token_s is None:
            self.first_token_s = time.monotonic()
        text = self.detok.text_of(self.tokens)
        hold = max(len(st) for st in self.stops) - 1  # a stop may have begun in text already searched
        cut = _first_stop(text, self.stops, max(self.checked - hold, 0))
        self.checked = len(text)
        return cut


class BatchRunner:
    """Serves Batch API batches on the engine's router (see module docstring); a daemon thread.

    Args:
        store: the SQL store (batches, their results, the input files).
        engine: the front door's engine (its router, tokenizer, online load).
        model_name: the served model (a line naming another is an error line, 404).
        max_inflight: batch lines on the pipeline at once.
        pause_above_online: open online requests above which no batch line is submitted.
        poll_s: seconds between two looks at the store.
        log: one line per event worth telling.
        run_key: this server's serving run: a batch is served by the one server that claimed it
            (``inference_jobs.owner_run_key``, :meth:`Store.claim_batch`) and taken over once its owner has ended
            or sent no heartbeat for :data:`BATCH_OWNER_SILENT_S`; None serves every batch (a server alone on
            its store).
        expiry_check_s: seconds between two looks for batches past their completion window.
    """

    def __init__(self, store, engine: FrontDoorEngine, model_name: str, *, max_inflight: int = 8,
                 pause_above_online: int = 8, poll_s: float = 0.5, log: Callable[[str], None] = print,
                 run_key: str | None = None, expiry_check_s: float = EXPIRY_CHECK_S):
        self.db, self.engine, self.model_name, self.run_key = store, engine, model_name, run_key
        self.expiry_check_s = expiry_check_s
        self._expiry_checked_s = -float("inf")  # monotonic time of the last look
        self.max_inflight, self.pause_above_online, self.poll_s, self.log = (max_inflight, pause_above_online,
                                                                           poll_s, log)
        self._lock = threading.Lock()
        self._inflight: dict[str, tuple[int, BatchLine, Any, float]] = {}  # request id -> job, line, shapes, t0
        self._lines: dict[int, list[BatchLine]] = {}
        self._finished: dict[int, set[str]] = {}  # job id -> custom ids with a result row
        self._errors: dict[int, int] = {}  # job id -> steps in a row that raised
        self._watches: dict[str, _StopWatch] = {}  # request id -> its stop watch (lines with stop sequences)
        self._stopped: list[str] = []  # request ids answered at a stop sequence, to cancel in the pipeline
        self._answered_early: set[str] = set()  # ... whose pipeline result, if it still comes, is dropped
        self._submissions = itertools.count()
        self._stop = threading.Event()
        self._wake = threading.Event()  # the loop's next step is due now (stop, or a line answered at a stop)
        self._thread = threading.Thread(target=self._run, name="flexpipe-batches", daemon=True)

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Submit nothing more (lines in flight are served again by the next server: they have no row)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def inflight(self, job_id: int) -> int:
        """Lines of job ``job_id`` on the pipeline now."""
        with self._lock:
            return sum(1 for j, *_ in self._inflight.values() if j == job_id)

    # -- router side --------------------------------------------------------------------------------
    def on_result(self, out: RequestOutput) -> None:
        """A batch line finished (a pump thread): build its response and write its row. A row that cannot
        be written is logged and the line served again later; the pump thread (the pipeline's) goes on."""
        try:
            self._on_result(out)
        except Exception as exc:
            self._not_stored(out.request_id, exc)

    def _not_stored(self, request_id: str, exc: Exception) -> None:
        """A line's answer raised before or while its row was written: out of flight, so it is served again."""
        with self._lock:
            self._inflight.pop(request_id, None)
        self.log(f"batch runner: the result of {request_id} was not stored ({type(exc).__name__}: {exc}); "
                 "the line is served again")

    def _on_result(self, out: RequestOutput) -> None:
        with self._lock:  # the line stays in flight until its row is written (else a step could serve it again)
            entry = self._inflight.get(out.request_id)
            self._watches.pop(out.request_id, None)
            if out.request_id in self._answered_early:
                return
        if entry is None:
            return
        self._answer(out.request_id, entry, list(out.output_token_ids), out.finish_reason, len(out.prompt_token_ids),
                     out.ttft_s, out.tpot_s)

    def on_token(self, request_id: str, index: int, token_id: int) -> None:
        """A batch line's sampled token (a pump thread): a line with stop sequences is answered at the token
        that completes one, and its generation cancelled (by the runner's thread, off the pump's)."""
        with self._lock:
            watch = self._watches.get(request_id)
            try:
                cut = watch.add(index, token_id) if watch is not None else None
            except Exception as exc:  # never the pipeline's pump: the line is answered from its whole result
                del self._watches[request_id]
                self.log(f"batch runner: {request_id}'s stop sequences are checked at its end "
                         f"({type(exc).__name__}: {exc})")
                return
            if cut is None or request_id in self._answered_early:
                return
            entry = self._inflight.get(request_id)
            if entry is None:
                return
            del self._watches[request_id]
            self._answered_early.add(request_id)
            self._stopped.append(request_id)
        self._wake.set()  # cancelled by the runner's thread at once, not at its next poll
        assert watch is not None and watch.first_token_s is not None
        n = len(watch.tokens)
        tpot_s = (time.monotonic() - watch.first_token_s) / (n - 1) if n > 1 else None
        try:
            self._answer(request_id, entry, watch.tokens, "stop", watch.prompt_tokens,
                         watch.first_token_s - entry[3], tpot_s)
        except Exception as exc:
            self._not_stored(request_id, exc)

    def _answer(self, request_id: str, entry: tuple[int, BatchLine, Any, float], tokens: list[int],
                finish: str | None, prompt_tokens: int, ttft_s: float, tpot_s: float | None) -> None:
        """Write a line's response from its output ``tokens``, cut at its first stop sequence (as the endpoint
        cuts it), and count it in the offline metrics."""
        job_id, line, shapes, t0 = entry
        text = self.engine.tokenizer.decode(tokens, skip_special_tokens=True)
        stops = tuple(_stops(line.body))
        cut = _first_stop(text, stops, 0)
        completion_tokens = len(tokens)
        if cut is not None:  # counted as the endpoint counts it: through the token that completed the stop
            text, finish = text[:cut], "stop"
            completion_tokens = tokens_through_stop(self.engine.tokenizer, tokens, stops)
        body = shapes.response(text, finish, prompt_tokens, completion_tokens)
        e2e_s = time.monotonic() - t0
        # the row holds the tokens the response counts (through the stop): the batch's usage sums them
        if not self._write(job_id, line, 200, body, tokens[:completion_tokens], prompt_tokens, request_id=request_id,
                           ttft_ms=1e3 * ttft_s, tpot_ms=1e3 * tpot_s if tpot_s is not None else None,
                           e2e_ms=1e3 * e2e_s, gear_key=self._serving_gear()):
            return  # answered before (expired as it ran): counted then
        metrics = self.engine.metrics
        metrics.generation_tokens.labels("offline").inc(len(tokens))
        metrics.prompt_tokens.labels("offline").inc(prompt_tokens)
        metrics.ttft.labels("offline").observe(ttft_s)
        metrics.e2e.labels("offline").observe(e2e_s)
        if tpot_s is not None:
            metrics.tpot.labels("offline").observe(tpot_s)

    def _serving_gear(self) -> str | None:
        """The gear serving when a line is answered (``request_results.gear_key``), None before a pipeline is up."""
        router = self.engine.router
        active = router.active if router is not None else None
        return active.gear.gear_id if active is not None else None

    def _cancel_stopped(self) -> None:
        """Cancel in the pipeline the lines answered at a stop sequence (their later tokens are nobody's)."""
        with self._lock:
            stopped, self._stopped = self._stopped, []
        for rid in stopped:
            if self._cancel_in_pipeline(rid):  # else its result is dropped when it comes
                with self._lock:
                    self._answered_early.discard(rid)  # cancelled (or already finished): no result comes now

    def _cancel_in_pipeline(self, rid: str) -> bool:
        """Cancel batch request ``rid`` on the router (counted when it was still running); False (logged) when the
        router raised: the other cancels go on."""
        try:
            if self.engine.router is not None and self.engine.router.cancel(rid):
                self.engine.metrics.cancelled.labels("offline").inc()
            return True
        except Exception as exc:
            self.log(f"batch runner: {rid} was not cancelled ({type(exc).__name__}: {exc})")
            return False

    def on_refused(self, request_id: str, reason: str) -> None:
        """The pipeline refused a batch line (e.g. larger than its KV pool): an error line."""
        with self._lock:
            entry = self._inflight.get(request_id)
            self._watches.pop(request_id, None)
            if request_id in self._answered_early:  # answered at its stop sequence (moved, then refused)
                return
        if entry is not None:
            job_id, line, _, _ = entry
            try:
                self._write(job_id, line, 400, APIError(400, f"the pipeline refused the request: {reason}").body(),
                            request_id=request_id)
            except Exception as exc:
                self.log(f"batch runner: the refusal of {request_id} was not stored ({type(exc).__name__}: {exc}); "
                         "the line is served again")

    # -- the loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._cancel_stopped()
                self._step()
            except Exception as exc:  # the store or a bad row: say so, try again at the next poll
                self.log(f"batch runner: {type(exc).__name__}: {exc}")

    def _step(self) -> None:
        """One look at the store: the batches that may still need this server (read by status, so the batches of
        weeks past are not read at every poll)."""
        batch = InferenceJobKind.BATCH.value
        now = time.monotonic()
        if now - self._expiry_checked_s >= self.expiry_check_s:  # a 24-h window needs no half-second clock
            self._expiry_checked_s = now
            self._expire_due()
            self._cancel_expired_elsewhere()
        if self.run_key is not None:
            for job in self.db.jobs(kind=batch, statuses=LINES_MAY_TRAIL, owner_run_key=self.run_key):
                if is_api_batch(job):
                    self._release_cancelled(job)
        runnable = [job for job in self.db.jobs(kind=batch, statuses=RUNNABLE) if is_api_batch(job)]
        self._forget({job.id for job in runnable})
        for job in runnable:
            try:
                if not self._serves(job):
                    continue
                self._step_job(job)
                self._errors.pop(job.id, None)
            except Exception as exc:  # this batch only: the others go on
                self._job_failed(job, exc)

    def _expire_due(self) -> None:
        """Expire the batches whose completion window has passed (any server may: :meth:`Store.expire_batch` is a
        compare-and-set), and cancel the lines of them in flight here (answered ``batch_expired``)."""
        for job in self.db.batches_past_deadline():
            if not is_api_batch(job):
                continue
            try:
                try:
                    keys = [line.custom_id for line in self._job_lines(job)]
                except (BatchInputGone, APIError):  # gone or unreadable: nothing to answer line by line, it ends all the same
                    keys = []
                ended = self.db.expire_batch(job.id, keys, output_text=json.dumps({"error": BATCH_EXPIRED_ERROR}),
                                             results_expire_at=results_expire_at(job))
            except Exception as exc:  # this batch only: the next poll tries again
                self.log(f"batch {job.job_key}: not expired yet ({type(exc).__name__}: {exc})")
                continue
            if ended is None:  # ended meanwhile, or a line answered as it was read: the next poll sees
                continue
            if ended.status == InferenceJobStatus.DONE.value:
                self.log(f"batch {job.job_key}: completed ({len(keys)} lines; every line was answered when its "
                         "completion window passed)")
                continue
            cancelled = self._cancel_lines_of(job.id)
            self.engine.metrics.requests.labels("batch", "expired").inc(ended.lines_expired)
            self.log(f"batch {job.job_key}: expired (its {job.config[API_BATCH_KEY]['completion_window']} completion "
                     f"window passed): {ended.lines_expired} of {job.total_requests} lines answered batch_expired"
                     + (f", {cancelled} cancelled in the pipeline" if cancelled else ""))

    def _cancel_expired_elsewhere(self) -> None:
        """Cancel the lines in flight here of batches another server has expired (their rows are written
        ``batch_expired``: a result that still came would be dropped). One status read per batch with lines here."""
        with self._lock:
            jobs = {j for j, *_ in self._inflight.values()}
        for job_id in jobs:
            if self.db.job_status(job_id) == InferenceJobStatus.EXPIRED.value:
                n = self._cancel_lines_of(job_id)
                if n:
                    self.log(f"batch job {job_id}: expired by another server: {n} line(s) in flight here cancelled")

    def _cancel_lines_of(self, job_id: int) -> int:
        """Take batch ``job_id``'s lines out of flight and cancel them in the pipeline (a result that still comes is
        dropped); how many were in flight."""
        with self._lock:
            rids = [rid for rid, (j, *_) in self._inflight.items() if j == job_id]
            for rid in rids:
                del self._inflight[rid]
                self._watches.pop(rid, None)
        for rid in rids:
            self._cancel_in_pipeline(rid)  # not cancelled: its result, if it comes, finds no line in flight
        return len(rids)

    def _forget(self, runnable: set[int]) -> None:
        """Drop the parsed lines and finished ids of the batches that are not runnable (ended, paused) and have no
        line in flight here: a server that serves batches for weeks keeps only those it serves now (a paused one
        is read again from the store when it is admitted)."""
        with self._lock:
            keep = runnable | {job_id for job_id, *_ in self._inflight.values()}
            for cache in (self._lines, self._finished):
                for job_id in [j for j in cache if j not in keep]:
                    del cache[job_id]

    def _release_cancelled(self, job) -> None:
        """A cancelled (or failed) batch this server owns, with no line of it in flight any more: give up the
        ownership, so that the other servers on the store read it ``cancelled`` (not ``cancelling``) and serve its
        files."""
        if self.run_key is not None and job.owner_run_key == self.run_key and self.inflight(job.id) == 0:
            if self.db.release_batch(job.id, self.run_key):
                self.log(f"batch {job.job_key}: cancelled, no line of it in flight here any more: released")

    def _serves(self, job) -> bool:
        """Whether this server serves ``job``: it owns it, or claims it (not claimed yet, or its owner has ended or
        fallen silent: taken over, logged)."""
        owner = job.owner_run_key
        if self.run_key is None or owner == self.run_key:
            return True
        why = None
        if owner is not None:
            why = owner_gone(self.db, owner)
            if why is None:
                return False  # another live server serves it
        if not self.db.claim_batch(job.id, self.run_key, owner):
            return False
        self.log(f"batch {job.job_key}: served here" + (f", taken over from run {owner} ({why})" if owner else ""))
        return True

    def _job_failed(self, job, exc: Exception) -> None:
        """One batch's step raised: say so once; after :data:`MAX_JOB_ERRORS` in a row, fail the batch with
        the error (its finished lines are kept), so that one bad batch never stalls the others."""
        n = MAX_JOB_ERRORS if isinstance(exc, BatchInputGone) else self._errors.get(job.id, 0) + 1
        self._errors[job.id] = n
        what = f"{type(exc).__name__}: {exc}"
        if n == 1:
            self.log(f"batch {job.job_key}: {what} (the batch fails if this repeats {MAX_JOB_ERRORS} times)")
        if n >= MAX_JOB_ERRORS:
            self._errors.pop(job.id, None)
            # only a batch that may still run: one cancelled meanwhile (then its input deleted) stays cancelled
            if self.db.transition_job(job.id, InferenceJobStatus.FAILED, UNFINISHED_JOB_STATUSES, error=what[:500],
                                      results_expire_at=results_expire_at(job)):
                self.log(f"batch {job.job_key}: failed: {what}")

    def _step_job(self, job) -> None:
        deadline = epoch_s(job.expires_at)
        if deadline is not None and deadline <= time.time():  # its window has passed: expired at the next look
            return
        lines = self._job_lines(job)
        finished = self._finished_ids(job.id)
        if len(finished) >= len(lines):
            if self.inflight(job.id) == 0 and self.db.transition_job(
                    job.id, InferenceJobStatus.DONE, RUNNABLE, results_expire_at=results_expire_at(job)):
                self.log(f"batch {job.job_key}: completed ({len(lines)} lines)")
            return
        # compare-and-set: a cancel or pause written since the batch was read (its input may take seconds to parse)
        # is not overwritten; the batch is then not served
        if job.status != InferenceJobStatus.RUNNING.value and not self.db.transition_job(
                job.id, InferenceJobStatus.RUNNING, (InferenceJobStatus.QUEUED.value, InferenceJobStatus.ADMITTED.value)):
            return
        self._submit(job, lines, finished)

    def _submit(self, job, lines: list[BatchLine], finished: set[str]) -> None:
        if self.engine.router is None or self.engine.draining or self._online_open() > self.pause_above_online:
            return
        if self.db.job_status(job.id) not in RUNNABLE:  # cancelled or paused since this poll read it: nothing more
            return
        with self._lock:  # a line leaves _inflight only once its custom id is in ``finished`` (same lock)
            busy = {(j, ln.index) for j, ln, _, _ in self._inflight.values()}
            room = self.max_inflight - len(self._inflight)
            todo = [ln for ln in lines
                    if ln.custom_id not in finished and (job.id, ln.index) not in busy][:max(room, 0)]
        endpoint = job.config[API_BATCH_KEY]["endpoint"]
        for line in todo:
            try:
                gen, shapes = self._prepare(endpoint, line)
            except APIError as exc:
                self._write(job.id, line, exc.status, exc.body())
                continue
            # a fresh id per submission: the router refuses an id it has seen, and a line whose row could
            # not be written is served again
            rid = f"{BATCH_PREFIX}{job.id}:{line.index}:{next(self._submissions)}"
            with self._lock:
                self._inflight[rid] = (job.id, line, shapes, time.monotonic())
                if gen.stop:
                    self._watches[rid] = _StopWatch(tuple(gen.stop), len(gen.prompt_token_ids),
                                                    IncrementalDetokenizer(self.engine.tokenizer), [])
            try:
                self.engine.router.submit([Request(rid, list(gen.prompt_token_ids), gen.max_tokens,
                                                   priority=PRIORITY_OFFLINE, temperature=gen.temperature,
                                                   top_p=gen.top_p, seed=gen.seed,
                                                   eos_token_ids=self.engine.eos_token_ids)])
            except BaseException:
                with self._lock:
                    self._inflight.pop(rid, None)
                    self._watches.pop(rid, None)
                raise

    def _online_open(self) -> int:
        return self.engine.pending

    def _prepare(self, endpoint: str, line: BatchLine):
        """The line's generation and response shapes, exactly as the endpoint would serve its body."""
        try:
            if endpoint == "/v1/completions":
                body: Any = CompletionRequest.model_validate(line.body)
            else:
                body = ChatCompletionRequest.model_validate(line.body)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = field_path(err.get("loc", ()))  # as the endpoint names it (``stop``, not ``stop.str``)
            raise APIError(400, f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param=param) from None
        if body.model != self.model_name:
            raise APIError(404, f"The model '{body.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0])
        if body.stream:
            raise APIError(400, "stream is not supported in a batch", param="stream")
        if endpoint == "/v1/completions":
            return completion_generation(self.engine, body), completion_shapes(self.model_name)
        return chat_generation(self.engine, body), chat_shapes(self.model_name)

    # -- rows -----------------------------------------------------------------------------------------
    def _job_lines(self, job) -> list[BatchLine]:
        if job.id not in self._lines:
            spec = job.config[API_BATCH_KEY]
            content = self.db.api_file_content(spec["input_file_id"])
            if content is None:  # deleted as the batch was created: nothing to serve, ever
                raise BatchInputGone(f"its input file {spec['input_file_id']} is no longer stored (deleted)")
            self._lines[job.id] = parse_batch_input(content, spec["endpoint"], spec["input_file_id"])
        return self._lines[job.id]

    def _finished_ids(self, job_id: int) -> set[str]:
        if job_id not in self._finished:
            self._finished[job_id] = self.db.done_request_keys(job_id, any_status=True)
        return self._finished[job_id]

    def _write(self, job_id: int, line: BatchLine, status_code: int, body: dict, tokens: list[int] | None = None,
               prompt_tokens: int = 0, request_id: str | None = None, gear_key: str | None = None,
               **latencies) -> bool:
        """Store the line's result row (``gear_key``: the gear that served it, None for a line never served), then
        (under one lock) mark it finished and take ``request_id`` out of flight; whether the row is new (False: the
        line had one, e.g. ``batch_expired`` written as it ran: then it is not counted in the metrics again). A row
        that cannot be written only takes the request out of flight: the line is served again."""
        ok = status_code == 200
        record = {"status_code": status_code, "body": body}
        try:
            stored = self.db.write_result(job_id, line.custom_id, prompt_tokens=prompt_tokens,
                                          output_token_ids=tokens or [],
                                          status=RequestResultStatus.DONE if ok else RequestResultStatus.FAILED,
                                          gear_key=gear_key, output_text=json.dumps(record), **latencies)
        except Exception:
            if request_id is not None:
                with self._lock:
                    self._inflight.pop(request_id, None)
            raise
        with self._lock:
            if job_id in self._finished:  # else forgotten (the batch ended): read from the store if it runs again
                self._finished[job_id].add(line.custom_id)
            if request_id is not None:
                self._inflight.pop(request_id, None)
        if stored:
            self.engine.metrics.requests.labels("batch", (finish_reason(body) or "stop") if ok else
                                                f"error_{status_code}").inc()
        return stored


def finish_reason(body: dict) -> str | None:
    """The finish reason of a response body's one choice."""
    choices = body.get("choices") or [{}]
    return choices[0].get("finish_reason")


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    return [stop] if isinstance(stop, str) else [s for s in (stop or []) if isinstance(s, str) and s]


# -- the batch object and its files ----------------------------------------------------------------------
def create_batch(store, input_file_id: str, endpoint: str, completion_window: str,
                 metadata: dict[str, str] | None, output_expires_after_s: int = DEFAULT_BATCH_FILE_EXPIRY_S) -> dict:
    """Check the input file and store the batch (status ``queued``; its output and error files expire
    ``output_expires_after_s`` after it has ended); returns the batch object.

    Raises:
        APIError: 400 an endpoint FlexPipe does not batch, a window other than 24h, a bad line (see
            :func:`parse_batch_input`); 404 no such file.
    """
    if endpoint not in BATCH_ENDPOINTS:
        raise APIError(400, f"endpoint: expected one of {list(BATCH_ENDPOINTS)}, got {endpoint!r}", param="endpoint")
    window_s = COMPLETION_WINDOWS_S.get(completion_window)
    if window_s is None:
        raise APIError(400, f"completion_window: only {', '.join(COMPLETION_WINDOWS_S)} is supported, got "
                       f"{completion_window[:80]!r}", param="completion_window")
    info = store.api_file(input_file_id)
    content = store.api_file_content(input_file_id) if info is not None and not info.expired() else None
    if content is None:
        raise APIError(404, f"No such file: {input_file_id}", param="input_file_id", code="file_not_found")
    lines = parse_batch_input(content, endpoint, input_file_id)
    batch_id = f"batch_{uuid.uuid4().hex}"
    created_s = int(time.time())
    config = {API_BATCH_KEY: {"input_file_id": input_file_id, "endpoint": endpoint,
                              "completion_window": completion_window, "metadata": dict(metadata or {}),
                              "created_at": created_s, "output_expires_after_s": output_expires_after_s}}
    deadline = dt.datetime.fromtimestamp(created_s + window_s, dt.UTC)
    if store.add_file_batch(batch_id, input_file_id, config, len(lines), expires_at=deadline) is None:  # gone since
        raise APIError(404, f"No such file: {input_file_id}", param="input_file_id", code="file_not_found")
    return batch_object(store, _job(store, batch_id), None)


def _output_expires_after_s(job) -> int:
    """How long after a batch ended its output and error files expire, seconds: its ``output_expires_after``
    (batches stored before it had one: 30 days)."""
    return int(job.config[API_BATCH_KEY].get("output_expires_after_s", DEFAULT_BATCH_FILE_EXPIRY_S))


def results_expire_at(job, now_s: float | None = None) -> dt.datetime:
    """When the output and error files of ``job``, a batch ending now (``now_s``, epoch seconds), expire."""
    return dt.datetime.fromtimestamp((time.time() if now_s is None else now_s) + _output_expires_after_s(job), dt.UTC)


def _job(store, batch_id: str, param: str = "batch_id"):
    job = store.job_by_key(batch_id)
    if job is not None and job.kind == InferenceJobKind.BATCH.value and is_api_batch(job):
        return job
    raise APIError(404, f"No batch found with id '{batch_id}'", param=param, code="batch_not_found")


def batch_ended_s(job) -> int | None:
    """When an ended batch ended (epoch seconds): its files' expiry less its ``output_expires_after`` (fixed when it
    ended; its ``updated_at`` moves with later writes: a release, a prune), else (not ended) its ``updated_at``."""
    expires = epoch_s(job.results_expire_at)
    return expires - _output_expires_after_s(job) if expires is not None else epoch_s(job.updated_at)


def lines_still_coming(store, job, runner: BatchRunner | None) -> bool:
    """Whether a cancelled (or failed) batch may still get result rows: lines of it are in flight on ``runner``, or
    another server owns it and is live (it releases the batch once its last line in flight has finished,
    :meth:`Store.release_batch`; an owner that ended or fell silent for :data:`BATCH_OWNER_SILENT_S` sends nothing
    more: its lines in flight have no row). False for any other status (a completed batch keeps its owner: all its
    rows are written)."""
    if job.status not in LINES_MAY_TRAIL:
        return False
    if runner is not None and runner.inflight(job.id):
        return True
    owner = job.owner_run_key
    if owner is None or (runner is not None and owner == runner.run_key):
        return False
    return owner_gone(store, owner) is None


def batch_object(store, job, runner: BatchRunner | None) -> dict:
    """OpenAI's batch object for a stored batch job."""
    spec = job.config[API_BATCH_KEY]
    counts = store.batch_result_counts(job.id)  # pruned rows' counts included, in one read
    completed, failed = counts.completed, counts.failed
    status = {"queued": "validating", "admitted": "in_progress", "running": "in_progress", "paused": "in_progress",
              "done": "completed", "failed": "failed", "cancelled": "cancelled", "expired": "expired"}[job.status]
    trailing = lines_still_coming(store, job, runner)
    if status == "cancelled" and trailing:
        status = "cancelling"
    # a failed batch's finished lines are kept and served, once its last lines in flight have come
    final = status in ("completed", "cancelled", "failed", "expired") and not trailing
    stamp = batch_ended_s(job)
    errors = None
    if status == "failed" and job.error:  # why, as OpenAI's batch object tells it
        errors = {"object": "list", "data": [{"code": "batch_failed", "message": job.error, "param": None,
                                              "line": None}]}
    return {"id": job.job_key, "object": "batch", "endpoint": spec["endpoint"], "errors": errors,
            "input_file_id": spec["input_file_id"], "completion_window": spec["completion_window"],
            "status": status, "output_file_id": f"{job.job_key}-output" if final and completed else None,
            "error_file_id": f"{job.job_key}-errors" if final and failed else None,
            "created_at": spec["created_at"], "in_progress_at": spec["created_at"] if status != "validating" else None,
            "completed_at": stamp if status == "completed" else None,
            "cancelling_at": stamp if status in ("cancelling", "cancelled") else None,
            "cancelled_at": stamp if status == "cancelled" else None,
            "failed_at": stamp if status == "failed" else None,
            "expires_at": epoch_s(job.expires_at), "expired_at": stamp if status == "expired" else None,
            "request_counts": {"total": job.total_requests, "completed": completed, "failed": failed},
            "usage": _usage(counts.input_tokens, counts.output_tokens),
            "metadata": spec.get("metadata") or None}


def _usage(input_tokens: int | None, output_tokens: int | None) -> dict | None:
    """OpenAI's batch ``usage``: the tokens of the batch's completed lines (None: not known, see
    :class:`~flexpipe_dag.sql.jobs.BatchResultCounts`). FlexPipe caches no prompt prefix and has no reasoning tokens."""
    if input_tokens is None or output_tokens is None:
        return None
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": input_tokens + output_tokens}


def list_batches(store, runner: BatchRunner | None, limit: int = 20, after: str | None = None) -> dict:
    """OpenAI's list of batches, newest first (at most ``limit``), those created before batch ``after`` when
    given (a cursor: the last id of the page before, as the OpenAI SDKs' auto-pagination sends it).

    Raises:
        APIError: 400 ``after`` names no batch.
    """
    before = None
    if after is not None:
        try:
            before = _job(store, after, param="after").id
        except APIError:
            raise APIError(400, f"after: no batch {after[:80]!r} (a cursor is the last id of the page before)",
                           param="after") from None
    page = list(itertools.islice((j for j in store.jobs_newest_first(InferenceJobKind.BATCH.value, before)
                                  if is_api_batch(j)), limit + 1))
    return list_object([batch_object(store, j, runner) for j in page[:limit]], len(page) > limit)


def get_batch(store, batch_id: str, runner: BatchRunner | None) -> dict:
    """The batch object of ``batch_id`` (APIError 404 when there is none)."""
    return batch_object(store, _job(store, batch_id), runner)


def cancel_batch(store, batch_id: str, runner: BatchRunner | None) -> dict:
    """Cancel a batch that has not ended (a finished one is returned as it is).

    Raises:
        APIError: 404 no such batch.
    """
    job = _job(store, batch_id)
    if store.transition_job(job.id, InferenceJobStatus.CANCELLED, UNFINISHED_JOB_STATUSES,
                            results_expire_at=results_expire_at(job)):
        if runner is not None:
            runner.log(f"batch {job.job_key}: cancelled ({store.batch_result_counts(job.id).answered} of {job.total_requests} lines "
                       f"kept, {runner.inflight(job.id)} in flight finish first)")
    return batch_object(store, _job(store, batch_id), runner)


def _line_order(store, job) -> Callable[[Any], tuple[int, int]]:
    """Sort key of a batch's result rows: their lines' order in the input file, or, once that file has been
    deleted or pruned, the order the rows were written (OpenAI's output files promise no order: a line is found by
    its ``custom_id``)."""
    spec = job.config[API_BATCH_KEY]
    content = store.api_file_content(spec["input_file_id"])
    order = ({ln.custom_id: ln.index for ln in parse_batch_input(content, spec["endpoint"], spec["input_file_id"])}
             if content is not None else {})
    return lambda r: (order.get(r.request_key, len(order)), r.id)


@dataclass(frozen=True)
class BatchFile:
    """A batch's generated output or error file: its bytes, when the batch ended (epoch seconds, the
    file object's ``created_at``: the same at every read) and when the file expires (None: never)."""

    content: bytes
    created_at: int
    expires_at: int | None = None


def batch_file(store, file_id: str, runner: BatchRunner | None = None) -> BatchFile | None:
    """A batch's generated output or error file (``<batch id>-output`` / ``-errors``), or None when
    ``file_id`` names no such file: the batch has not ended (still running, or cancelled with lines in
    flight on ``runner``: the file is written when the batch ends, as its batch object names it then), it has no
    line of that kind (its batch object names no such file), or the file has expired."""
    for suffix, ok in (("-output", True), ("-errors", False)):
        if file_id.endswith(suffix):
            try:
                job = _job(store, file_id[:-len(suffix)])
            except APIError:
                return None
            if job.status not in ENDED_JOB_STATUSES:
                return None
            if lines_still_coming(store, job, runner):  # "cancelling": its last rows are still coming
                return None
            expires_at = epoch_s(job.results_expire_at)
            if "results_pruned" in job.config[API_BATCH_KEY] or (expires_at is not None and expires_at <= time.time()):
                return None
            rows = [r for r in store.results(job.id) if (r.status == RequestResultStatus.DONE.value) == ok]
            if not rows:
                return None
            rows.sort(key=_line_order(store, job))
            out = []
            for r in rows:
                record = json.loads(r.output_text or "{}")
                line: dict[str, Any] = {"id": f"batch_req_{r.id}", "custom_id": r.request_key}
                if ok:
                    line.update(response={"status_code": 200, "request_id": f"req_{r.id}", "body": record["body"]},
                                error=None)
                elif "status_code" not in record and "error" in record:  # never served (an expired batch's line)
                    line.update(response=None, error=record["error"])
                else:
                    line.update(response={"status_code": record.get("status_code", 400),
                                          "request_id": f"req_{r.id}", "body": record.get("body")},
                                error=(record.get("body") or {}).get("error"))
                out.append(json.dumps(line))
            return BatchFile(("\n".join(out) + "\n").encode(), batch_ended_s(job) or 0, expires_at)
    return None
