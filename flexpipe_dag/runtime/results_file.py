"""The append-only JSON-lines results file of ``flexpipe run`` and the scoring launcher (:class:`JsonlSink`).

A results file holds one *result record* per line: a JSON object with a non-empty string ``id`` and
a string ``gear_id`` (what :func:`~flexpipe_dag.runtime.batch.result_record` and the scoring records
hold), each line ended by ``\\n`` (``\\r\\n`` is read too). Blank lines are skipped.

Opening a sink reads the file line by line (streaming: one line at a time, each at most
:data:`MAX_RESULT_LINE_BYTES`) and changes nothing. It refuses, naming the file (and the line):

* a path that is a symbolic link, a directory, a FIFO, a device or a socket (opened with
  ``O_NOFOLLOW`` and ``O_NONBLOCK``, then ``fstat``-checked), or that is not UTF-8;
* a non-empty line that is not a result record (a config file, a prompts file, a gear);
* bare ``\\r`` line endings (old Mac text), rather than reading the file as one torn line;
* a final line without its newline that is not a whole record, when no complete record line
  comes before it (it is not cut: nothing shows the file is a results file), or when it does not
  start a JSON object.

The one repair, made at the first append (so a command refused for any other reason leaves the
file as it was): a final line without its newline is either a whole record, which is kept and gets
its newline, or a write a crash cut short, which is truncated away (its request runs again; the
note names the file and the bytes). Pure Python, no third-party imports.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.user_files import MIB, file_kind

_log = logging.getLogger(__name__)

#: Longest line a results file may hold, bytes (a record holds at most a few MiB of token ids or log-probs).
MAX_RESULT_LINE_BYTES = 64 * MIB
#: What a result record is, for messages.
RECORD_TEXT = "a result record (a JSON object with string fields 'id' and 'gear_id')"
_NOT_RESULTS = "refusing to append to a file that is not a flexpipe results file (left unchanged)"
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


@dataclass
class ResultsScan:
    """What :func:`scan_results` found in a results file.

    Attributes:
        done_ids: the ids of the whole records (the unterminated last line's too when it is whole).
        records: how many whole record lines.
        size_bytes: the file's size when scanned (0: missing or empty).
        tail_start: byte offset where an unterminated last line starts (``size_bytes``: none).
        tail_torn: the unterminated last line is a torn write, to be cut at ``tail_start``
            (false: a whole record or blank, which only needs its newline).
        identity: ``(st_dev, st_ino)`` of the scanned file (``None``: it did not exist).
    """

    done_ids: set[str] = field(default_factory=set)
    records: int = 0
    size_bytes: int = 0
    tail_start: int = 0
    tail_torn: bool = False
    identity: tuple[int, int] | None = None


def _open_results(path: Path, flags: int, source: str, mode: int = 0o644) -> int | None:
    """A file descriptor of the results file ``path`` (``None``: missing and ``flags`` do not create it).

    Raises:
        InputError: a symbolic link, not a regular file, or it cannot be opened (``source`` named).
    """
    try:
        fd = os.open(path, flags | _OPEN_FLAGS, mode)
    except FileNotFoundError:
        if flags & os.O_CREAT:
            raise InputError(source, None, "cannot create it: its directory does not exist") from None
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(source, None, "is a symbolic link; expected the results file itself (give its real "
                                           "path; a link could point at any file)") from None
        if exc.errno == errno.EISDIR:
            raise InputError(source, None, "is a directory; expected a JSON-lines results file") from None
        raise InputError(source, None, f"cannot open it: {exc.strerror or exc}") from None
    try:
        mode_bits = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise InputError(source, None, f"cannot stat it: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode_bits):
        os.close(fd)
        raise InputError(source, None, f"is {file_kind(mode_bits)}; expected a regular JSON-lines results file")
    return fd


def _record(body: bytes) -> dict[str, Any] | bool:
    """``body`` (one line, no line ending) as a result record; ``True`` when it is JSON but not a
    record, ``False`` when it does not parse (or is not UTF-8)."""
    try:
        obj = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return False
    if isinstance(obj, dict) and isinstance(obj.get("id"), str) and obj["id"] and isinstance(obj.get("gear_id"), str):
        return obj
    return True


def _scan_stream(fh: BinaryIO, source: str) -> ResultsScan:
    """Check every line of the binary stream ``fh`` (read from its start, line by line).

    Raises:
        InputError: as :func:`scan_results`.
    """
    scan = ResultsScan()
    offset = lineno = 0
    tail: int | None = None  # where an unterminated last line starts
    while True:
        raw = fh.readline(MAX_RESULT_LINE_BYTES + 1)
        if not raw:
            break
        lineno += 1
        start, offset = offset, offset + len(raw)
        if len(raw) > MAX_RESULT_LINE_BYTES:
            raise InputError(source, f"line {lineno}", f"longer than {MAX_RESULT_LINE_BYTES // MIB} MiB; "
                                                       f"{_NOT_RESULTS}")
        terminated = raw.endswith(b"\n")
        body = raw[:-1] if terminated else raw
        body = body[:-1] if body.endswith(b"\r") else body  # \r\n, or a write torn between \r and \n
        if b"\r" in body:
            raise InputError(source, f"line {lineno}", "holds a bare carriage return (\\r line endings); expected "
                                                       "\\n or \\r\\n line endings (left unchanged)")
        if not body.strip():
            if not terminated:
                tail = start  # blank: only needs its newline
            continue
        rec = _record(body)
        if isinstance(rec, dict):
            scan.done_ids.add(rec["id"])
            scan.records += 1
            if not terminated:
                tail = start  # a whole record that lacks its newline: kept, newline added
            continue
        if terminated or rec is True:
            what = "not valid JSON" if rec is False else "JSON but not a result record"
            raise InputError(source, f"line {lineno}", f"{what}; expected {RECORD_TEXT} per line; {_NOT_RESULTS}")
        if not body.lstrip().startswith(b"{"):
            raise InputError(source, f"line {lineno}", f"the last line ends without a newline at byte {offset} and "
                                                       f"is not a torn JSON record; {_NOT_RESULTS}")
        if scan.records == 0:
            raise InputError(source, f"line {lineno}", f"the last line ends without a newline at byte {offset} and "
                                                       f"is not a whole result record, and no whole record comes "
                                                       f"before it, so it is not cut; {_NOT_RESULTS}")
        tail, scan.tail_torn = start, True
    scan.size_bytes = offset
    scan.tail_start = offset if tail is None else tail
    return scan


def _scan_fd(fd: int, source: str) -> ResultsScan:
    """:func:`_scan_stream` over the open file ``fd`` (from byte 0; ``fd`` stays open)."""
    info = os.fstat(fd)
    os.lseek(fd, 0, os.SEEK_SET)
    with open(fd, "rb", closefd=False) as fh:
        scan = _scan_stream(fh, source)
    scan.identity = (info.st_dev, info.st_ino)
    return scan


def scan_results(path: str | os.PathLike, source: str | None = None) -> ResultsScan:
    """Check the results file ``path`` line by line, changing nothing.

    Args:
        path: the results file (a missing one is an empty scan).
        source: the name in messages (default: ``path``).

    Returns:
        The ids it holds and the repair its last line needs (:class:`ResultsScan`).

    Raises:
        InputError: a symbolic link, directory, FIFO, device or socket; unreadable; a line over
            :data:`MAX_RESULT_LINE_BYTES`; a non-empty line that is not a result record (not UTF-8,
            not JSON, or JSON without the record's fields), named by its number; bare ``\\r`` line
            endings; an unterminated last line that does not start a JSON object, or with no whole
            record before it.
    """
    name = source or str(path)
    fd = _open_results(Path(path), os.O_RDONLY, name)
    if fd is None:
        return ResultsScan()
    try:
        return _scan_fd(fd, name)
    except OSError as exc:
        raise InputError(name, None, f"cannot read it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _fix_tail(fd: int, scan: ResultsScan, path: Path, on_note: Callable[[str], None] | None) -> int:
    """Make the open results file ``fd`` (opened ``O_APPEND``) end at a line boundary as ``scan``
    says: cut a torn last line (fsynced, noted) or give a whole last line its newline. Returns the
    bytes cut."""
    if scan.tail_start >= scan.size_bytes:
        return 0
    if not scan.tail_torn:
        os.write(fd, b"\n")
        os.fsync(fd)
        if on_note is not None:
            on_note(f"results file {path}: its last line was a whole record without a trailing newline; "
                    f"kept, newline added")
        return 0
    os.ftruncate(fd, scan.tail_start)
    os.fsync(fd)
    dropped = scan.size_bytes - scan.tail_start
    if on_note is not None:
        on_note(f"results file {path}: dropped a torn last line ({dropped} bytes after byte {scan.tail_start}, no "
                f"trailing newline: a write cut short by a crash); its request runs again")
    return dropped


def repair_torn_tail(path: str | os.PathLike, on_note: Callable[[str], None] | None = None) -> int:
    """Check the results file ``path`` (:func:`scan_results`) and make it end at a line boundary now.

    A last line without its newline is either a whole record (kept; the newline is added) or a write
    a crash cut short, which is truncated away (fsynced) so the next append is not glued onto it; its
    request is then not in the file, so a resumed job runs it again. A missing or empty file, or one
    ending in a newline, is left alone. :class:`JsonlSink` makes the same repair at its first append.

    Args:
        path: the results file.
        on_note: called with one line naming the file (and the bytes dropped) when it repaired.

    Returns:
        The number of bytes dropped (0 when none was cut).

    Raises:
        InputError: as :func:`scan_results` (the file is then left as it was), or it cannot be
            opened for writing.
    """
    p, name = Path(path), str(path)
    fd = _open_results(p, os.O_RDWR | os.O_APPEND, name)
    if fd is None:
        return 0
    try:
        return _fix_tail(fd, _scan_fd(fd, name), p, on_note)
    except OSError as exc:
        raise InputError(name, None, f"cannot repair it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


class JsonlSink:
    """Append-only JSONL results file: one record per line, fsynced per write, idempotent per ``id``.

    Opening scans the file (:func:`scan_results`: streaming, nothing changed) for the ids it already
    holds, refusing a path or content that is not a results file. The first :meth:`write` makes the
    repair the last line needs (:func:`repair_torn_tail`'s: a torn write cut away, noted through
    ``on_note``, default a logged warning; a whole record given its newline) and then appends; a
    file that changed since the scan is scanned again first. Every write opens the path with
    ``O_NOFOLLOW``, so a symbolic link put there after the scan is refused too.

    Args:
        path: the results file (created on the first write, mode 0644 before the umask).
        on_note: called with one line when the last line was repaired.

    Raises:
        InputError: (a ValueError) from the constructor or the first write, as :func:`scan_results`.
    """

    def __init__(self, path: str | os.PathLike, on_note: Callable[[str], None] | None = None):
        self.path = Path(path)
        self._on_note = on_note or _log.warning
        self._scan: ResultsScan | None = scan_results(self.path)
        self._done = set(self._scan.done_ids)
        #: bytes of a torn last line cut at the first write (0: none, or not written yet)
        self.repaired_bytes = 0

    @property
    def torn_tail_bytes(self) -> int:
        """Bytes of a torn last line the first write will cut (0: none, or already cut)."""
        scan = self._scan
        return scan.size_bytes - scan.tail_start if scan is not None and scan.tail_torn else 0

    def done_ids(self) -> set[str]:
        return set(self._done)

    def write(self, result: dict[str, Any]) -> None:
        """Append ``result`` (a record with ``id`` and ``gear_id``) unless its id is already done.

        Raises:
            InputError: the first write found the file no longer a results file (or a link).
            OSError: the write or fsync failed.
        """
        if result["id"] in self._done:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_results(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, str(self.path))
        assert fd is not None  # O_CREAT
        try:
            if self._scan is not None:
                self._repair(fd, self._scan)
                if result["id"] in self._done:  # the rescan found it written since the scan
                    return
            data = (json.dumps(result) + "\n").encode("utf-8")
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        self._done.add(result["id"])

    def _repair(self, fd: int, scan: ResultsScan) -> None:
        info = os.fstat(fd)
        if scan.identity != (info.st_dev, info.st_ino) or scan.size_bytes != info.st_size:
            scan = _scan_fd(fd, str(self.path))  # replaced or appended to since the scan: look again
            self._done |= scan.done_ids
        self.repaired_bytes = _fix_tail(fd, scan, self.path, self._on_note)
        self._scan = None
