"""Files uploaded through the front door's Files API (table ``api_files``): a batch's input lives in the
store, so a server restarted, or another one on the same store, reads the same bytes.

A file may expire (OpenAI's ``expires_after``): from then on it is neither listed nor served, and
:meth:`ApiFiles.prune_api_files` deletes it, unless a batch that has not ended still reads it. A file is
deleted at once by :meth:`ApiFiles.delete_api_file`, again unless such a batch reads it: its content goes, and
its row stays :data:`DELETED_ROW_KEEP_S` as a list cursor (a client that deletes each file of a page as it walks
the list asks for the next page after the id it has just deleted), then a prune removes it.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from datetime import UTC
from typing import Any, Literal

from sqlalchemy import and_, delete, func, or_, select

from flexpipe_dag.core.clock import epoch_s
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.status import UNFINISHED_JOB_STATUSES, InferenceJobKind, InferenceJobStatus
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.session import StoreBase, checked_text

#: Largest file the store takes, bytes (OpenAI's Batch API input limit is 200 MB; a CPU-sized default).
MAX_FILE_BYTES = 64 * 2**20
#: Statuses of a batch that still reads its input file: it may still submit lines (a paused one is resumed, a
#: silent owner's taken over by another server). A cancelled, completed or failed batch reads it no more (its
#: output file falls back to the order its rows were written when the input has gone).
READING_JOB_STATUSES = UNFINISHED_JOB_STATUSES
#: How long a deleted file's emptied row stays as a list cursor, seconds.
DELETED_ROW_KEEP_S = 86400.0


@dataclass(frozen=True)
class ApiFileInfo:
    """A stored file, without its bytes: ``created_at`` and ``expires_at`` in Unix seconds (UTC);
    ``expires_at`` None: kept until deleted."""

    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None = None

    def expired(self, now_s: float | None = None) -> bool:
        """Whether the file has expired at ``now_s`` (epoch seconds; default the clock)."""
        return self.expires_at is not None and self.expires_at <= (time.time() if now_s is None else now_s)


@dataclass(frozen=True)
class FileDeletion:
    """What :meth:`ApiFiles.delete_api_file` did: ``deleted`` the file; else ``readers`` names the batches that
    have not ended and still read it (nothing deleted), or both are empty: no such file."""

    deleted: bool
    readers: tuple[str, ...] = ()


@dataclass(frozen=True)
class FilePruneResult:
    """What :meth:`ApiFiles.prune_api_files` deleted (or, on a dry run, would delete): ``files`` expired files of
    ``bytes`` bytes in all; ``kept`` expired files a batch that has not ended still reads (they stay); ``cursors``
    emptied rows of files deleted more than :data:`DELETED_ROW_KEEP_S` ago (list cursors no longer kept)."""

    files: int
    bytes: int
    kept: int
    dry_run: bool
    cursors: int = 0

    def describe(self) -> str:
        """One line for a person."""
        verb = "would delete" if self.dry_run else "deleted"
        line = f"uploaded files: {verb} {self.files:,d} expired file(s), {self.bytes:,d} bytes"
        if self.cursors:
            line += f", and {self.cursors:,d} row(s) of files deleted over a day ago"
        return line + (f"; {self.kept:,d} expired file(s) kept: a batch still reads them" if self.kept else "")


class ApiFiles(StoreBase):
    """Uploaded files (``api_files``).

    Raises:
        InputError: a file over :data:`MAX_FILE_BYTES`, or an id, purpose or name too long (nothing written).
    """

    #: The largest file :meth:`save_api_file` takes (what the upload route reads at most).
    max_api_file_bytes = MAX_FILE_BYTES

    def save_api_file(self, file_id: str, purpose: str, filename: str, content: bytes,
                      expires_at_s: float | None = None) -> ApiFileInfo:
        """Store one file under ``file_id``; it expires at ``expires_at_s`` (epoch seconds; None: never)."""
        where = "api_files"
        checked_text(file_id, where, "id", 64)
        checked_text(purpose, where, "purpose", 20)
        checked_text(filename, where, "filename", 255)
        if len(content) > MAX_FILE_BYTES:
            raise InputError(where, "content", f"{len(content)} bytes; at most {MAX_FILE_BYTES} are stored")
        expires = None if expires_at_s is None else dt.datetime.fromtimestamp(expires_at_s, UTC)
        with self.session() as s:
            row = m.ApiFile(id=file_id, purpose=purpose, filename=filename, bytes=len(content), content=content,
                            expires_at=expires)
            s.add(row)
            s.flush()
            return _info(row)

    def api_file(self, file_id: str) -> ApiFileInfo | None:
        """The file's facts (an expired one too: see :meth:`ApiFileInfo.expired`), or None when no such file is
        stored (or it was deleted)."""
        with self.session() as s:
            row = s.get(m.ApiFile, file_id)
            return _info(row) if row is not None and row.deleted_at is None else None

    def list_api_files(self, limit: int, purpose: str | None = None, *, after: str | None = None,
                       order: Literal["asc", "desc"] = "desc",
                       now_s: float | None = None) -> tuple[list[ApiFileInfo], bool]:
        """Up to ``limit`` stored files that have not expired at ``now_s`` (their facts, not their bytes), newest
        first (``order="asc"``: oldest first), of ``purpose`` when given, those after the file ``after`` in that
        order (a cursor: the last id of the page before); and whether more are stored.

        Raises:
            InputError: ``after`` names no stored file (a cursor must be a file's id).
        """
        cols = (m.ApiFile.id, m.ApiFile.purpose, m.ApiFile.filename, m.ApiFile.bytes, m.ApiFile.created_at,
                m.ApiFile.expires_at)
        newest_first = order == "desc"
        keys = (m.ApiFile.created_at, m.ApiFile.id)
        query = _ordered(cols, keys, newest_first).limit(limit + 1)
        now = dt.datetime.fromtimestamp(time.time() if now_s is None else now_s, UTC)
        query = query.where(or_(m.ApiFile.expires_at.is_(None), m.ApiFile.expires_at > now),
                            m.ApiFile.deleted_at.is_(None))
        if purpose is not None:
            query = query.where(m.ApiFile.purpose == purpose)
        with self.session() as s:
            if after is not None:
                cursor = s.execute(select(*keys).where(m.ApiFile.id == after)).first()
                if cursor is None:  # a deleted file's row stays a day: this one never was, or went long ago
                    raise InputError("api_files", "after", f"no stored file {after[:80]!r} (a cursor is the last id of the "
                                                           "page before)")
                query = query.where(_past(keys, (cursor[0], cursor[1]), newest_first))
            rows = s.execute(query).all()
        return [_info(r) for r in rows[:limit]], len(rows) > limit

    def api_file_content(self, file_id: str) -> bytes | None:
        """The file's bytes (an expired one's too, while it is stored), or None when no such file is stored (or it
        was deleted)."""
        with self.session() as s:
            row = s.get(m.ApiFile, file_id)
            return bytes(row.content) if row is not None and row.deleted_at is None else None

    def api_file_readers(self, file_id: str) -> list[str]:
        """The ids of the Batch API batches that have not ended and read ``file_id`` as their input."""
        with self.session() as s:
            return list(s.scalars(_readers_query(file_id)))

    def delete_api_file(self, file_id: str, now_s: float | None = None) -> FileDeletion:
        """Delete an uploaded file, unless a batch that has not ended reads it (then nothing is deleted and the
        batches are named: cancel them first, or wait for them). A file that has expired at ``now_s`` (epoch seconds;
        default the clock) is not found, as it is not served. Its content goes at once; its row stays
        :data:`DELETED_ROW_KEEP_S` as a list cursor."""
        with self.session() as s:  # the row locked: no batch is created on it between the check and the delete
            row = _locked_live_file(s, file_id, now_s)
            if row is None:
                return FileDeletion(False)
            readers = tuple(s.scalars(_readers_query(file_id)))
            if readers:
                return FileDeletion(False, readers)
            row.deleted_at, row.content = dt.datetime.fromtimestamp(time.time() if now_s is None else now_s, UTC), b""
            return FileDeletion(True)

    def add_file_batch(self, job_key: str, file_id: str, config: dict[str, Any], total_requests: int,
                       now_s: float | None = None, expires_at: dt.datetime | None = None) -> int | None:
        """Store a Batch API batch (an ``inference_jobs`` row, status ``queued``, priority -1) that reads ``file_id``,
        in the transaction that finds the file (locked) not deleted and not expired at ``now_s``: a delete or a prune
        never takes a file a batch has just been created on. ``expires_at``: the end of its completion window (an
        aware datetime; None: no deadline). The job's id, or None when the file is gone.

        Raises:
            InputError: ``expires_at`` is not an aware datetime (nothing written).
        """
        if expires_at is not None and not (isinstance(expires_at, dt.datetime) and expires_at.tzinfo is not None):
            raise InputError("inference_jobs", "expires_at", f"expected an aware datetime or None, got {expires_at!r}")
        with self.session() as s:
            if _locked_live_file(s, file_id, now_s) is None:
                return None
            job = m.InferenceJob(job_key=job_key, kind=InferenceJobKind.BATCH.value,
                                 status=InferenceJobStatus.QUEUED.value, priority=-1, source_path=file_id,
                                 config=dict(config), total_requests=total_requests, expires_at=expires_at)
            s.add(job)
            s.flush()
            return job.id

    def prune_api_files(self, *, dry_run: bool = False, now_s: float | None = None) -> FilePruneResult:
        """Delete the files that have expired at ``now_s`` (epoch seconds; default the clock), except those a batch
        that has not ended still reads (they go at a later prune, once it has), and the emptied rows of files deleted
        more than :data:`DELETED_ROW_KEEP_S` ago (counted apart: they hold no content). ``dry_run``: only count."""
        now_s = time.time() if now_s is None else now_s
        now = dt.datetime.fromtimestamp(now_s, UTC)
        live = m.ApiFile.deleted_at.is_(None)
        expired = live & m.ApiFile.expires_at.is_not(None) & (m.ApiFile.expires_at <= now)
        read = m.ApiFile.id.in_(select(m.InferenceJob.source_path).where(*_reading()))
        old_tombstone = m.ApiFile.deleted_at < dt.datetime.fromtimestamp(now_s - DELETED_ROW_KEEP_S, UTC)
        with self.session() as s:
            gone = s.execute(select(func.count(), func.coalesce(func.sum(m.ApiFile.bytes), 0))
                             .where(expired & ~read)).one()
            kept = int(s.scalar(select(func.count()).where(expired & read)) or 0)
            cursors = int(s.scalar(select(func.count()).where(old_tombstone)) or 0)
            if not dry_run:
                s.execute(delete(m.ApiFile).where(or_(expired & ~read, old_tombstone))
                          .execution_options(synchronize_session=False))
        return FilePruneResult(int(gone[0]), int(gone[1]), kept, dry_run, cursors)


def _locked_live_file(s: Any, file_id: str, now_s: float | None):
    """In session ``s``: the ``api_files`` row of ``file_id``, locked for the transaction (``FOR UPDATE``; SQLite's
    ``BEGIN IMMEDIATE`` already holds the write lock), or None when it was deleted or has expired at ``now_s`` (epoch
    seconds; default the clock)."""
    row = s.scalar(select(m.ApiFile).where(m.ApiFile.id == file_id, m.ApiFile.deleted_at.is_(None))
                   .with_for_update())
    return None if row is None or _info(row).expired(now_s) else row


def _ordered(cols: tuple[Any, ...], keys: tuple[Any, Any], newest_first: bool):
    """``SELECT cols`` ordered by ``keys`` (descending when ``newest_first``)."""
    return select(*cols).order_by(*(k.desc() if newest_first else k.asc() for k in keys))


def _past(keys: tuple[Any, Any], cursor: tuple[Any, Any], newest_first: bool):
    """Rows strictly after ``cursor`` in the (``keys``) order: a keyset page boundary."""
    (first, second), (c1, c2) = keys, cursor
    if newest_first:
        return or_(first < c1, and_(first == c1, second < c2))
    return or_(first > c1, and_(first == c1, second > c2))


def _reading() -> tuple[Any, ...]:
    """Where-clauses of the batch jobs that still read their input file (``source_path`` is its id)."""
    return (m.InferenceJob.kind == InferenceJobKind.BATCH.value, m.InferenceJob.status.in_(READING_JOB_STATUSES),
            m.InferenceJob.source_path.is_not(None))


def _readers_query(file_id: str):
    return select(m.InferenceJob.job_key).where(*_reading(), m.InferenceJob.source_path == file_id) \
        .order_by(m.InferenceJob.id)


def _info(row) -> ApiFileInfo:
    """An ``api_files`` row (ORM object or selected columns) as :class:`ApiFileInfo`."""
    return ApiFileInfo(row.id, row.purpose, row.filename, row.bytes, epoch_s(row.created_at) or 0,
                       epoch_s(row.expires_at))
