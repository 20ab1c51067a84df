"""Read a user's file with a size cap, before anything parses it.

A path a user hands in (``--cluster``, ``--trace``, a control file, a model's ``config.json``, a
prompts file) may name a FIFO that never ends, a device such as ``/dev/zero``, or a file far larger
than any real input. :func:`read_user_bytes` opens it without blocking, refuses anything that is not
a regular file, refuses a file whose size is over the cap, and reads at most ``cap_bytes + 1`` bytes
(so a file that grows, or a ``/proc`` file that reports size 0, is still bounded).

Caps (documented limits of what FlexPipe reads; raise them here if a real input needs more):

* :data:`MAX_YAML_BYTES` 4 MiB: cluster profiles, control files, gears written as YAML (PyYAML is
  pure Python, about 1-2 MB/s, so this bounds the parse to a few seconds);
* :data:`MAX_JSON_BYTES` 64 MiB: cluster profiles and gears as JSON, a model's ``config.json``;
* :data:`MAX_TRACE_BYTES` 512 MiB: request traces (CSV / JSONL) and tide histories;
* :data:`MAX_PROMPTS_BYTES` 256 MiB: prompt files (JSONL) of ``flexpipe run`` and the batch job.

Pure Python, no third-party imports.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from flexpipe_dag.core.errors import InputError

MIB = 1024 * 1024
#: Largest YAML file FlexPipe parses, bytes.
MAX_YAML_BYTES = 4 * MIB
#: Largest JSON document (cluster profile, gear, model config.json) FlexPipe parses, bytes.
MAX_JSON_BYTES = 64 * MIB
#: Largest request trace or tide history (CSV / JSONL), bytes.
MAX_TRACE_BYTES = 512 * MIB
#: Largest prompts file (JSONL), bytes.
MAX_PROMPTS_BYTES = 256 * MIB
_CHUNK_BYTES = MIB


def _size_text(num_bytes: int) -> str:
    return f"{num_bytes / MIB:.0f} MiB" if num_bytes >= MIB else f"{num_bytes} bytes"


def file_kind(st_mode: int) -> str:
    """What a file that is not a regular file is, for messages: ``"a directory"``, ``"a FIFO (named
    pipe)"``, ``"a device"``, ``"a symbolic link"`` or ``"not a plain file"`` (a socket)."""
    if stat.S_ISDIR(st_mode):
        return "a directory"
    if stat.S_ISFIFO(st_mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(st_mode) or stat.S_ISBLK(st_mode):
        return "a device"
    if stat.S_ISLNK(st_mode):
        return "a symbolic link"
    return "not a plain file"


def read_user_bytes(path: str | Path, cap_bytes: int, *, what: str = "file", head_bytes: int | None = None,
                    source: str | None = None) -> bytes:
    """The bytes of the user's file ``path``, at most ``cap_bytes`` of them.

    Args:
        path: the file.
        cap_bytes: largest size accepted, bytes (a file over it is refused, not cut).
        what: what the file should be, for messages (``"cluster profile"``).
        head_bytes: read only the first ``head_bytes`` bytes (the size cap still applies to the file).
        source: the name in messages (default: ``path``).

    Returns:
        The file's content (or its first ``head_bytes`` bytes).

    Raises:
        InputError: the file is missing or unreadable, is not a regular file (a directory, a FIFO, a
            device such as /dev/zero, a socket), or holds more than ``cap_bytes`` bytes.
    """
    name = source or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError(name, None, f"cannot read file: file not found; expected a {what}") from None
    except OSError as exc:
        raise InputError(name, None, f"cannot read file: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(name, None, f"is {file_kind(info.st_mode)}; expected a regular file holding a {what}")
        if info.st_size > cap_bytes:
            raise InputError(name, None, f"{_size_text(info.st_size)} is over the {_size_text(cap_bytes)} limit "
                                         f"for a {what}")
        os.set_blocking(fd, True)
        limit = cap_bytes + 1 if head_bytes is None else min(head_bytes, cap_bytes + 1)
        chunks: list[bytes] = []
        got = 0
        while got < limit:
            chunk = os.read(fd, min(_CHUNK_BYTES, limit - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as exc:
        raise InputError(name, None, f"cannot read file: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if head_bytes is None and got > cap_bytes:
        raise InputError(name, None, f"more than {_size_text(cap_bytes)}, the limit for a {what}")
    return b"".join(chunks)


def decode_user_text(data: bytes, source: str, *, what: str = "text") -> str:
    """``data`` decoded as UTF-8 (a leading byte-order mark dropped).

    Raises:
        InputError: the bytes are not UTF-8 (``source`` named, with the byte offset).
    """
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(source, None, f"not UTF-8 text ({exc.reason} at byte {exc.start}); expected {what}") from None


def read_user_text(path: str | Path, cap_bytes: int, *, what: str = "file", source: str | None = None) -> str:
    """:func:`read_user_bytes` decoded as UTF-8.

    Raises:
        InputError: as :func:`read_user_bytes`, or the file is not UTF-8.
    """
    name = source or str(path)
    return decode_user_text(read_user_bytes(path, cap_bytes, what=what, source=name), name, what=what)


def check_output_file(path: str | Path, flag: str, what: str) -> Path:
    """Check, before any work, that ``path`` can be written as a file: not a directory, in a directory
    that exists (nothing is created). Returns it as a :class:`~pathlib.Path`.

    Args:
        path: the output path a user gave; flag: the flag that gave it (named in the error);
        what: the kind of file expected, e.g. ``"an HTML file path"``.

    Raises:
        InputError: ``path`` is a directory, or its directory does not exist.
    """
    out = Path(path)
    if out.is_dir():
        raise InputError(str(out), flag, f"is a directory; expected {what}")
    if not out.parent.is_dir():
        raise InputError(str(out), flag, f"directory {out.parent} does not exist")
    return out
