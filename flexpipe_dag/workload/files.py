"""Read a user's CSV / JSONL table into pandas with the size cap and the errors of the core's file reader.

Every table FlexPipe reads from a user's path (request traces, length files, tide histories) goes
through :func:`read_user_frame`: the file must be a regular file of at most
:data:`~flexpipe_dag.core.user_files.MAX_TRACE_BYTES` bytes of UTF-8 text, and whatever pandas
raises on it (a parse error, a nesting or memory error inside the JSON reader) comes back as one
:class:`~flexpipe_dag.core.errors.InputError` naming the file.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pandas as pd

from flexpipe_dag.core.errors import InputError, one_line
from flexpipe_dag.core.user_files import MAX_TRACE_BYTES, decode_user_text, read_user_bytes

#: How much of a file :func:`read_user_header` reads to find its header line, bytes.
HEADER_BYTES = 65536


def is_jsonl(path: Path) -> bool:
    """Whether ``path`` names a JSON-lines file (``.jsonl`` / ``.ndjson``)."""
    return path.suffix.lower() in (".jsonl", ".ndjson")


def read_user_header(path: Path, what: str) -> list[str]:
    """The comma-separated names on the first line of the CSV ``path`` (at most :data:`HEADER_BYTES` read).

    Raises:
        InputError: as :func:`~flexpipe_dag.core.user_files.read_user_bytes` (missing, not a regular
            file, over :data:`~flexpipe_dag.core.user_files.MAX_TRACE_BYTES`).
    """
    head = read_user_bytes(path, MAX_TRACE_BYTES, what=what, head_bytes=HEADER_BYTES)
    line = head.split(b"\n", 1)[0].decode("utf-8-sig", errors="replace")  # the full read checks the encoding
    return [name.strip() for name in line.split(",")]


def read_user_frame(path: Path, what: str, **read_kwargs: Any) -> pd.DataFrame:
    """The CSV (or, for ``.jsonl`` / ``.ndjson``, JSON-lines) file ``path`` as a DataFrame.

    Args:
        path: the file.
        what: what it should hold, for messages (``"request trace (CSV or JSONL)"``).
        read_kwargs: passed to ``pandas.read_csv`` (CSV only).

    Raises:
        InputError: the file is missing, not a regular file, over the size cap, empty, not UTF-8, or
            not parsable as its form (file named, the parser's reason cut to one line).
    """
    source = str(path)
    raw = read_user_bytes(path, MAX_TRACE_BYTES, what=what)
    if not raw.strip():
        raise InputError(source, None, f"file is empty; expected a {what} with a header row and at least one row")
    text = decode_user_text(raw, source, what=what)
    form = "JSONL" if is_jsonl(path) else "CSV"
    try:
        frame: pd.DataFrame
        if form == "JSONL":
            frame = pd.DataFrame.from_records(_jsonl_objects(text, source))
        else:
            frame = pd.read_csv(io.StringIO(text), **read_kwargs)
        return frame
    except InputError:  # a line named by _jsonl_objects
        raise
    except (ValueError, pd.errors.ParserError, RecursionError, MemoryError, OverflowError) as exc:
        raise InputError(source, None, f"cannot parse as {form}: {one_line(str(exc) or type(exc).__name__, 300)}") from None


def _jsonl_objects(text: str, source: str) -> list[dict[str, Any]]:
    """Each non-blank line of ``text`` as one JSON object, parsed strictly (:func:`~flexpipe_dag.core.user_yaml.load_user_json`:
    duplicate keys and ``NaN`` / ``Infinity`` refused, as every JSON file FlexPipe reads).

    Raises:
        InputError: a line that is not JSON or not an object (``source``, ``line N``); no line at all.
    """
    from flexpipe_dag.core.user_yaml import load_user_json

    rows: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = load_user_json(line, source)
        except InputError as exc:
            raise InputError(source, f"line {number}", exc.problem) from None
        if not isinstance(row, dict):
            raise InputError(source, f"line {number}", f"got a JSON {type(row).__name__}; expected one object per line "
                                                        '(e.g. {"arrival_s": 0.5, "input_tokens": 10, "output_tokens": 5})')
        rows.append(row)
    if not rows:
        raise InputError(source, None, "no JSON lines; expected one object per line")
    return rows
