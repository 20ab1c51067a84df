"""Files uploaded through the front door's Files API (table ``api_files``): a batch's input lives in the
store, so a server restarted, or another one on the same store, reads the same bytes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.session import StoreBase, checked_text

#: Largest file the store takes, bytes (OpenAI's Batch API input limit is 200 MB; a CPU-sized default).
MAX_FILE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ApiFileInfo:
    """A stored file, without its bytes: ``created_at`` in Unix seconds (UTC)."""

    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int


class ApiFiles(StoreBase):
    """Uploaded files (``api_files``).

    Raises:
        InputError: a file over :data:`MAX_FILE_BYTES`, or an id, purpose or name too long (nothing written).
    """

    #: The largest file :meth:`save_api_file` takes (what the upload route reads at most).
    max_api_file_bytes = MAX_FILE_BYTES

    def save_api_file(self, file_id: str, purpose: str, filename: str, content: bytes) -> ApiFileInfo:
        """Store one file under ``file_id``."""
        where = "api_files"
        checked_text(file_id, where, "id", 64)
        checked_text(purpose, where, "purpose", 20)
        checked_text(filename, where, "filename", 255)
        if len(content) > MAX_FILE_BYTES:
            raise InputError(where, "content", f"{len(content)} bytes; at most {MAX_FILE_BYTES} are stored")
        with self.session() as s:
            row = m.ApiFile(id=file_id, purpose=purpose, filename=filename, bytes=len(content), content=content)
            s.add(row)
            s.flush()
            return _info(row)

    def api_file(self, file_id: str) -> ApiFileInfo | None:
        """The file's facts, or None when no such file is stored."""
        with self.session() as s:
            row = s.get(m.ApiFile, file_id)
            return _info(row) if row is not None else None

    def list_api_files(self, limit: int, purpose: str | None = None) -> tuple[list[ApiFileInfo], bool]:
        """Up to ``limit`` stored files, newest first (their facts, not their bytes), of ``purpose``
        when given; and whether more are stored."""
        import sqlalchemy as sa

        cols = (m.ApiFile.id, m.ApiFile.purpose, m.ApiFile.filename, m.ApiFile.bytes, m.ApiFile.created_at)
        query = sa.select(*cols).order_by(m.ApiFile.created_at.desc(), m.ApiFile.id.desc()).limit(limit + 1)
        if purpose is not None:
            query = query.where(m.ApiFile.purpose == purpose)
        with self.session() as s:
            rows = s.execute(query).all()
        return [_info(r) for r in rows[:limit]], len(rows) > limit

    def api_file_content(self, file_id: str) -> bytes | None:
        """The file's bytes, or None when no such file is stored."""
        with self.session() as s:
            row = s.get(m.ApiFile, file_id)
            return bytes(row.content) if row is not None else None


def _info(row) -> ApiFileInfo:
    """An ``api_files`` row (ORM object or selected columns) as :class:`ApiFileInfo`."""
    return ApiFileInfo(row.id, row.purpose, row.filename, row.bytes,
                       int(row.created_at.replace(tzinfo=UTC).timestamp()))
