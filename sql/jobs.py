"""Inference jobs and their request results in the store."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.status import (
    API_BATCH_CONFIG_KEY,
    ENDED_JOB_STATUSES,
    RUNNABLE_JOB_STATUSES,
    UNFINISHED_JOB_STATUSES,
    InferenceJobKind,
    InferenceJobStatus,
    RequestResultStatus,
    checked,
)
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.session import StoreBase, checked_finite, checked_int, checked_text

#: The fields of a job :meth:`InferenceJobs.update_job` sets (what batch jobs, serving runs and the tide
#: sensor change); the id, key and kind are fixed when the job is created, its priority, source and config set by
#: each run that passes a config (:meth:`InferenceJobs.get_or_create_job`).
UPDATABLE_JOB_FIELDS: tuple[str, ...] = ("status", "total_requests", "malformed_rows", "admissions", "error",
                                         "gear_key", "results_expire_at")


@dataclass(frozen=True)
class ResultsPruneResult:
    """What :meth:`InferenceJobs.prune_batch_results` deleted (or, on a dry run, would delete): the result rows of
    ``batches`` Batch API batches whose output files had expired, ``rows`` in all."""

    batches: int
    rows: int
    dry_run: bool

    def describe(self) -> str:
        """One line for a person."""
        verb = "would delete" if self.dry_run else "deleted"
        return f"batch results: {verb} {self.rows:,d} row(s) of {self.batches:,d} batch(es) whose output files expired"


@dataclass(frozen=True)
class BatchResultCounts:
    """A Batch API batch's answered lines and the tokens of its completed ones (:meth:`InferenceJobs.batch_result_counts`).

    Attributes:
        completed, failed: lines answered 200, and answered with an error (``batch_expired`` included).
        input_tokens, output_tokens: prompt and output tokens of the completed lines (what OpenAI bills a batch
            for: its ``usage``), or None when a prune before these were kept (migration 0017) took some of them.
    """

    completed: int
    failed: int
    input_tokens: int | None = None
    output_tokens: int | None = None

    @property
    def answered(self) -> int:
        """Lines with a result."""
        return self.completed + self.failed

    def plus_kept(self, kept: dict[str, Any]) -> BatchResultCounts:
        """These counts (a batch's result rows) plus what its prunes kept (its config's ``results_pruned``); the token
        sums None when a prune before 0017 kept none (not known, never undercounted)."""
        tokens_known = self.input_tokens is not None and (not kept or "input_tokens" in kept)
        return BatchResultCounts(
            self.completed + int(kept.get("completed", 0)), self.failed + int(kept.get("failed", 0)),
            (self.input_tokens or 0) + int(kept.get("input_tokens", 0)) if tokens_known else None,
            (self.output_tokens or 0) + int(kept.get("output_tokens", 0)) if tokens_known else None)


@dataclass(frozen=True)
class BatchDeadlineEnd:
    """How :meth:`InferenceJobs.expire_batch` ended a batch: ``status`` ``expired`` (``lines_expired`` lines answered
    ``batch_expired``) or ``done`` (every line had been answered: it completed, as OpenAI reports such a batch)."""

    status: str
    lines_expired: int


class InferenceJobs(StoreBase):
    """Online and batch inference jobs (table ``inference_jobs``) and one result row per finished
    request, unique per (job, request key) so writes are idempotent (table ``request_results``).

    Raises:
        InputError: a job ``kind`` that is not an :class:`~flexpipe_dag.core.status.InferenceJobKind`, a
            job update that is not allowed (see :meth:`update_job`), or a result that cannot be stored
            (see :meth:`write_result`); the field is named and nothing is written.
        KeyError: an update or read of a job id that is not stored.
    """

    def get_or_create_job(self, job_key: str, kind: str = InferenceJobKind.BATCH, *, priority: int = 0,
                          source_path: str | None = None, gear_key: str | None = None,
                          config: dict[str, Any] | None = None) -> int:
        """The id of job ``job_key``, creating it (status ``queued``) if new; ``config`` relaunches it.

        A stored job given a ``config`` (a run of it) takes that config, ``priority`` and ``source_path``: the
        store holds what its latest run was given, so a relaunch by the tide sensor repeats it (also filling
        in a job stored with ``{}``). Without a ``config`` a stored job is left as it is.

        Raises:
            InputError: ``kind`` is not an :class:`~flexpipe_dag.core.status.InferenceJobKind` (nothing is written).
        """
        kind = checked(InferenceJobKind, kind, "inference_jobs", "kind").value
        with self.session() as s:
            job = s.scalar(select(m.InferenceJob).where(m.InferenceJob.job_key == job_key))
            if job is None:
                job = m.InferenceJob(job_key=job_key, kind=kind, status=InferenceJobStatus.QUEUED.value,
                                     priority=priority, source_path=source_path, gear_key=gear_key,
                                     config=dict(config or {}))
                s.add(job)
                s.flush()
            elif config is not None:
                job.config, job.priority, job.source_path = dict(config), priority, source_path
            return job.id

    def update_job(self, job_id: int, **fields: Any) -> None:
        """Set fields of a job: only those its runs change (:data:`UPDATABLE_JOB_FIELDS`): ``status``,
        ``total_requests``, ``malformed_rows``, ``admissions`` (integers), ``error`` and ``gear_key`` (strings
        or None), ``results_expire_at`` (an aware datetime or None).

        Raises:
            InputError: the field named and nothing of the call written: a field not in
                :data:`UPDATABLE_JOB_FIELDS` (the id, the job key, a misspelt name), a ``status`` that is not
                an :class:`~flexpipe_dag.core.status.InferenceJobStatus`, or a value of the wrong type.
            KeyError: ``job_id`` is not stored.
        """
        fields = self._checked_fields(fields)
        with self.session() as s:
            job = s.get(m.InferenceJob, job_id)
            if job is None:
                raise KeyError(job_id)
            for k, v in fields.items():
                setattr(job, k, v)

    @staticmethod
    def _checked_fields(fields: dict[str, Any]) -> dict[str, Any]:
        """``fields`` of an update, checked (see :meth:`update_job`); the status as its string value."""
        where = "inference_jobs"
        for name in fields:
            if name not in UPDATABLE_JOB_FIELDS:
                raise InputError(where, name, "not a field update_job sets; expected "
                                 f"{', '.join(UPDATABLE_JOB_FIELDS[:-1])} or {UPDATABLE_JOB_FIELDS[-1]}")
        if "status" in fields:
            fields["status"] = checked(InferenceJobStatus, fields["status"], where, "status").value
        for name in ("total_requests", "malformed_rows", "admissions"):
            if name in fields:
                fields[name] = checked_int(fields[name], where, name)
        if "error" in fields and fields["error"] is not None and not isinstance(fields["error"], str):
            raise InputError(where, "error", f"expected a string or None, got {fields['error']!r}")
        if "gear_key" in fields:
            checked_text(fields["gear_key"], where, "gear_key", 200, optional=True)
        expire = fields.get("results_expire_at")
        if expire is not None and not (isinstance(expire, dt.datetime) and expire.tzinfo is not None):
            raise InputError(where, "results_expire_at", f"expected an aware datetime or None, got {expire!r}")
        return fields

    def claim_batch(self, job_id: int, run_key: str, from_owner: str | None) -> bool:
        """Make serving run ``run_key`` the owner of batch ``job_id`` if its owner is still ``from_owner`` (None: not
        claimed yet) and it is still to be served (queued, admitted or running: a batch cancelled, paused or ended
        since the caller read it is not claimed): one atomic compare-and-set, so of two servers claiming at once
        exactly one wins. Returns whether ``run_key`` owns it now.

        Raises:
            InputError: ``run_key`` is not a string of at most 200 characters (nothing written).
        """
        checked_text(run_key, "inference_jobs", "owner_run_key", 200)
        owner = m.InferenceJob.owner_run_key
        q = update(m.InferenceJob).where(m.InferenceJob.id == job_id, m.InferenceJob.status.in_(RUNNABLE_JOB_STATUSES),
                                         owner.is_(None) if from_owner is None else owner == from_owner)
        with self.session() as s:
            # an UPDATE executes to a CursorResult (the one that has rowcount); Session.execute is typed Result
            won = cast(CursorResult[Any], s.execute(q.values(owner_run_key=run_key))).rowcount == 1
            return won or s.scalar(select(owner).where(m.InferenceJob.id == job_id)) == run_key

    def release_batch(self, job_id: int, run_key: str) -> bool:
        """Clear batch ``job_id``'s owner if it is still ``run_key`` (a compare-and-set): the owner of a cancelled
        batch does so once its last line in flight has finished, so that every server then reads it ``cancelled``
        and serves its files. Returns whether it was released.

        Raises:
            InputError: ``run_key`` is not a string of at most 200 characters (nothing written).
        """
        checked_text(run_key, "inference_jobs", "owner_run_key", 200)
        q = update(m.InferenceJob).where(m.InferenceJob.id == job_id, m.InferenceJob.owner_run_key == run_key)
        with self.session() as s:
            return cast(CursorResult[Any], s.execute(q.values(owner_run_key=None))).rowcount == 1

    def transition_job(self, job_id: int, status: str, from_statuses: Iterable[str], **fields: Any) -> bool:
        """Set a job's ``status`` (and ``fields``, as :meth:`update_job` takes them) only while its status is one of
        ``from_statuses``: a compare-and-set, so that a cancel, pause or end written meanwhile by another process (a
        client, the tide sensor, another server) is never overwritten by a writer that read the job before it.
        Whether the job moved.

        Raises:
            InputError: as :meth:`update_job` (nothing written).
        """
        fields = self._checked_fields({"status": status, **fields})
        with self.session() as s:
            moved = s.execute(update(m.InferenceJob)
                              .where(m.InferenceJob.id == job_id, m.InferenceJob.status.in_(list(from_statuses)))
                              .values(**fields))
            return cast(CursorResult[Any], moved).rowcount > 0

    def batches_past_deadline(self, now_s: float | None = None) -> list[m.InferenceJob]:
        """Batch jobs that have not ended and whose completion window (``expires_at``) has passed at ``now_s`` (epoch
        seconds; default the clock), oldest first: read through the (kind, status) index, so the weeks of ended
        batches are not read."""
        now = dt.datetime.fromtimestamp(time.time() if now_s is None else now_s, dt.UTC)
        job = m.InferenceJob
        with self.session() as s:  # sorted here: an ORDER BY id made SQLite walk the whole table in id order
            found = s.scalars(select(job).where(
                job.kind == InferenceJobKind.BATCH.value, job.status.in_(UNFINISHED_JOB_STATUSES),
                job.expires_at.is_not(None), job.expires_at <= now))
            return sorted(found, key=lambda j: j.id)

    def expire_batch(self, job_id: int, request_keys: Iterable[str], *, output_text: str,
                     results_expire_at: dt.datetime, now_s: float | None = None) -> BatchDeadlineEnd | None:
        """End batch ``job_id`` as ``expired`` if it has not ended and its completion window has passed at ``now_s``
        (a compare-and-set: of two servers expiring it at once, one does), writing a ``failed`` result row, whose
        ``output_text`` is ``output_text``, for each of ``request_keys`` (its lines) that has none yet, in the same
        transaction: a crash leaves the batch as it was, and its request counts and error file never show it half
        expired. A batch all of whose lines (``request_keys``, not empty) have rows ends ``done`` instead (its last
        row came before the runner's completion, or it was paused in between). ``results_expire_at``: when its output
        and error files expire. Returns how it ended, or None when it was not ended (ended before, not due, or a line
        answered meanwhile: the caller tries again).

        The job row is locked ``FOR NO KEY UPDATE`` on PostgreSQL: a result row's insert (its foreign key takes a key
        share of the job row) is not blocked by it, so a line answered meanwhile fails this transaction (the caller
        tries again) rather than deadlocking with it.

        Raises:
            InputError: a request key that is not a string of at most 200 characters, ``output_text`` not a string,
                or ``results_expire_at`` not an aware datetime (nothing written).
        """
        fields = self._checked_fields({"status": InferenceJobStatus.EXPIRED, "results_expire_at": results_expire_at})
        keys = [cast(str, checked_text(k, "request_results", "request_key", 200)) for k in request_keys]
        if not isinstance(output_text, str):
            raise InputError("request_results", "output_text", f"expected a string, got {output_text!r}")
        now = dt.datetime.fromtimestamp(time.time() if now_s is None else now_s, dt.UTC)
        try:
            with self.session() as s:
                job = s.scalar(select(m.InferenceJob).where(
                    m.InferenceJob.id == job_id, m.InferenceJob.status.in_(UNFINISHED_JOB_STATUSES),
                    m.InferenceJob.expires_at.is_not(None), m.InferenceJob.expires_at <= now)
                    .with_for_update(key_share=True))
                if job is None:
                    return None
                answered = set(s.scalars(select(m.RequestResult.request_key)
                                         .where(m.RequestResult.job_id == job_id)))
                rows: list[dict[str, Any]] = [
                    {"job_id": job_id, "request_key": k, "status": RequestResultStatus.FAILED.value, "gear_key": None,
                     "prompt_tokens": 0, "output_tokens": 0, "output_token_ids": [], "output_text": output_text}
                    for k in dict.fromkeys(keys) if k not in answered]
                if rows:
                    s.execute(insert(m.RequestResult), rows)
                elif keys:  # every line answered: it completed
                    fields["status"] = InferenceJobStatus.DONE.value
                for name, value in fields.items():
                    setattr(job, name, value)
                return BatchDeadlineEnd(fields["status"], len(rows))
        except IntegrityError:  # a line's row was written between the read and the insert: all rolled back
            return None

    def job_status(self, job_id: int) -> str:
        """A job's status as stored now."""
        with self.session() as s:
            job = s.get(m.InferenceJob, job_id)
            if job is None:
                raise KeyError(job_id)
            return job.status

    def jobs(self, status: str | None = None, kind: str | None = None, *, statuses: Iterable[str] | None = None,
             owner_run_key: str | None = None) -> list[m.InferenceJob]:
        """Jobs, highest priority first, then oldest first (optionally of one status, or any of ``statuses``, of a
        kind, and owned by the serving run ``owner_run_key``)."""
        with self.session() as s:
            q = select(m.InferenceJob).order_by(m.InferenceJob.priority.desc(), m.InferenceJob.id)
            if status is not None:
                q = q.where(m.InferenceJob.status == status)
            if statuses is not None:
                q = q.where(m.InferenceJob.status.in_(list(statuses)))
            if kind is not None:
                q = q.where(m.InferenceJob.kind == kind)
            if owner_run_key is not None:
                q = q.where(m.InferenceJob.owner_run_key == owner_run_key)
            return list(s.scalars(q))

    def job_by_key(self, job_key: str) -> m.InferenceJob | None:
        """The job stored under ``job_key``, or None."""
        with self.session() as s:
            return s.scalar(select(m.InferenceJob).where(m.InferenceJob.job_key == job_key))

    def jobs_newest_first(self, kind: str, before_id: int | None = None,
                          chunk: int = 200) -> Iterator[m.InferenceJob]:
        """Jobs of ``kind``, newest (highest id) first, those with an id below ``before_id`` when given; read
        ``chunk`` rows at a time, so a reader that stops early (a page of a list) reads no more of the table."""
        while True:
            with self.session() as s:
                q = select(m.InferenceJob).where(m.InferenceJob.kind == kind).order_by(m.InferenceJob.id.desc())
                if before_id is not None:
                    q = q.where(m.InferenceJob.id < before_id)
                rows = list(s.scalars(q.limit(chunk)))
            yield from rows
            if len(rows) < chunk:
                return
            before_id = rows[-1].id

    def write_result(self, job_id: int, request_key: str, *, prompt_tokens: int, output_token_ids: list[int],
                     status: str = "done", gear_key: str | None = None, output_text: str | None = None,
                     ttft_ms: float | None = None, tpot_ms: float | None = None,
                     e2e_ms: float | None = None) -> bool:
        """Write one request's result idempotently; returns False if it was already stored.

        Only a stored result of the same ``(job_id, request_key)`` (also one a concurrent writer stored
        first) means "already stored"; every other reason a row cannot be written is refused.
        ``ttft_ms``, ``tpot_ms`` and ``e2e_ms`` are None when there is no value (``tpot_ms`` of a
        one-token output); NaN is never one.

        Raises:
            InputError: the field named and nothing written: ``job_id`` is no stored job; ``request_key``
                is not a string of at most 200 characters; ``prompt_tokens`` or an output token id is not
                an integer; a latency is NaN or infinite; ``status`` is not a
                :class:`~flexpipe_dag.core.status.RequestResultStatus`; ``gear_key`` is not a string of at
                most 200 characters (or None); or the database refused the row for another reason.
        """
        where = "request_results"
        status = checked(RequestResultStatus, status, where, "status").value
        checked_int(job_id, where, "job_id")
        checked_text(request_key, where, "request_key", 200)
        prompt_tokens = checked_int(prompt_tokens, where, "prompt_tokens")
        if isinstance(output_token_ids, (str, bytes)) or not isinstance(output_token_ids, Iterable):
            raise InputError(where, "output_token_ids", f"expected a list of integers, got {output_token_ids!r}")
        token_ids = [checked_int(t, where, f"output_token_ids[{i}]") for i, t in enumerate(output_token_ids)]
        checked_text(gear_key, where, "gear_key", 200, optional=True)
        if output_text is not None and not isinstance(output_text, str):
            raise InputError(where, "output_text", f"expected a string or None, got {output_text!r}")
        ttft_ms, tpot_ms, e2e_ms = (checked_finite(v, where, name, optional=True) for name, v in
                                    (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms), ("e2e_ms", e2e_ms)))
        try:
            return self._insert_result(job_id, request_key, prompt_tokens, token_ids, status, gear_key,
                                       output_text, ttft_ms, tpot_ms, e2e_ms)
        except IntegrityError as exc:
            if self._result_stored(job_id, request_key):
                return False  # a concurrent writer stored the same request first
            if not self._job_stored(job_id):  # deleted since the check
                raise InputError(where, "job_id", f"no inference job with id {job_id}") from None
            reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc).splitlines()[0]
            raise InputError(where, None, f"not written: {reason}") from None

    def _result_stored(self, job_id: int, request_key: str) -> bool:
        with self.session() as s:
            return s.scalar(select(m.RequestResult.id).where(m.RequestResult.job_id == job_id,
                                                             m.RequestResult.request_key == request_key)) is not None

    def _job_stored(self, job_id: int) -> bool:
        with self.session() as s:
            return s.get(m.InferenceJob, job_id) is not None

    def _insert_result(self, job_id: int, request_key: str, prompt_tokens: int, output_token_ids: list[int],
                       status: str, gear_key: str | None, output_text: str | None, ttft_ms: float | None,
                       tpot_ms: float | None, e2e_ms: float | None) -> bool:
        with self.session() as s:
            if s.get(m.InferenceJob, job_id) is None:
                raise InputError("request_results", "job_id", f"no inference job with id {job_id}; "
                                 "create it with get_or_create_job first")
            exists = s.scalar(select(m.RequestResult.id).where(m.RequestResult.job_id == job_id,
                                                               m.RequestResult.request_key == request_key))
            if exists is not None:
                return False
            s.add(m.RequestResult(job_id=job_id, request_key=request_key, status=status, gear_key=gear_key,
                                  prompt_tokens=prompt_tokens, output_tokens=len(output_token_ids),
                                  output_token_ids=list(output_token_ids), output_text=output_text,
                                  ttft_ms=ttft_ms, tpot_ms=tpot_ms, e2e_ms=e2e_ms))
            return True

    def done_request_keys(self, job_id: int, *, any_status: bool = False) -> set[str]:
        """Request keys of a job with a ``done`` result (a re-run skips them); ``any_status``: with a result of any
        status (a Batch API line answered with an error is answered too). Only the keys are read."""
        where = [m.RequestResult.job_id == job_id]
        if not any_status:
            where.append(m.RequestResult.status == RequestResultStatus.DONE.value)
        with self.session() as s:
            return set(s.scalars(select(m.RequestResult.request_key).where(*where)))

    def prune_batch_results(self, *, dry_run: bool = False, now_s: float | None = None) -> ResultsPruneResult:
        """Delete the result rows of the Batch API batches that have ended and whose output and error files have
        expired at ``now_s`` (``results_expire_at``; epoch seconds, default the clock). Each batch keeps its counts
        (its config's ``results_pruned``: completed, failed, added to at each prune, so a line that came after one,
        from an owner that was still finishing it, is counted and pruned at the next), so its batch object reads as
        before, without files. One batch to a transaction, oldest first: a crash keeps what it has not reached, and
        a writer waits for one batch's rows at most. ``dry_run``: only count."""
        now = dt.datetime.fromtimestamp(time.time() if now_s is None else now_s, dt.UTC)
        has_rows = select(m.RequestResult.id).where(m.RequestResult.job_id == m.InferenceJob.id).exists()
        due = (m.InferenceJob.results_expire_at.is_not(None) & (m.InferenceJob.results_expire_at <= now)
               & m.InferenceJob.status.in_(ENDED_JOB_STATUSES) & has_rows)
        if dry_run:
            with self.session() as s:
                batches = int(s.scalar(select(func.count()).select_from(m.InferenceJob).where(due)) or 0)
                rows = s.scalar(select(func.count()).select_from(m.RequestResult).where(
                    m.RequestResult.job_id.in_(select(m.InferenceJob.id).where(due))))
            return ResultsPruneResult(batches, int(rows or 0), True)
        batches = rows = 0
        after_id = 0
        while True:
            with self.session() as s:
                job = s.scalar(select(m.InferenceJob).where(due, m.InferenceJob.id > after_id)
                               .order_by(m.InferenceJob.id).limit(1).with_for_update())
                if job is None:
                    return ResultsPruneResult(batches, rows, False)
                after_id = job.id
                spec = dict(job.config.get(API_BATCH_CONFIG_KEY) or {})
                total = BatchResultCounts(*map(int, s.execute(select(*_row_figures(job.id))).one())).plus_kept(
                    spec.get("results_pruned") or {})
                kept: dict[str, Any] = {"completed": total.completed, "failed": total.failed,
                                        "at": int(now.timestamp())}
                if total.input_tokens is not None:  # a prune before 0017 kept no token sums: none from now on
                    kept.update(input_tokens=total.input_tokens, output_tokens=total.output_tokens)
                spec["results_pruned"] = kept
                job.config = {**job.config, API_BATCH_CONFIG_KEY: spec}
                gone = s.execute(delete(m.RequestResult).where(m.RequestResult.job_id == job.id)
                                 .execution_options(synchronize_session=False))
                rows += cast(CursorResult[Any], gone).rowcount
                batches += 1

    def batch_result_counts(self, job_id: int) -> BatchResultCounts:
        """A Batch API batch's lines answered and its completed lines' tokens (:class:`BatchResultCounts`): its result
        rows and those a prune deleted (its config's ``results_pruned``), read in one statement, so a prune running
        meanwhile never shows a count dropping; without loading the rows' responses.

        Raises:
            KeyError: ``job_id`` is not stored.
        """
        with self.session() as s:
            found = s.execute(select(m.InferenceJob.config, *_row_figures(job_id))
                              .where(m.InferenceJob.id == job_id)).first()
        if found is None:
            raise KeyError(job_id)
        config, *figures = found
        return BatchResultCounts(*map(int, figures)).plus_kept((config or {}).get(API_BATCH_CONFIG_KEY, {}).get("results_pruned")
                                                     or {})

    def results(self, job_id: int) -> list[m.RequestResult]:
        """A job's results, in the order they were written."""
        with self.session() as s:
            return list(s.scalars(select(m.RequestResult).where(m.RequestResult.job_id == job_id)
                                  .order_by(m.RequestResult.id)))


def _row_figures(job_id: int) -> tuple[Any, ...]:
    """Scalar subqueries over job ``job_id``'s result rows, in :class:`BatchResultCounts`' order: lines completed,
    lines failed, prompt tokens and output tokens of the completed ones (0 when there is none)."""
    rows = m.RequestResult
    done = rows.status == RequestResultStatus.DONE.value

    def of_rows(what: Any, where: Any) -> Any:
        return select(func.coalesce(what, 0)).select_from(rows).where(rows.job_id == job_id, where).scalar_subquery()

    return (of_rows(func.count(), done), of_rows(func.count(), ~done), of_rows(func.sum(rows.prompt_tokens), done),
            of_rows(func.sum(rows.output_tokens), done))
