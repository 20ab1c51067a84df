"""Load request traces with pandas and validate them, naming the file, row and field of any bad value.

Formats:

* **Azure LLM inference trace 2023** (Azure/AzurePublicDataset, Splitwise ISCA'24):
  ``TIMESTAMP,ContextTokens,GeneratedTokens`` with timestamps like ``2023-11-16 18:15:46.6805900``
  (7 fractional digits). Arrival seconds are measured from the first request.
* **Generic** CSV or JSONL (``.jsonl`` / ``.ndjson``): ``arrival_s,input_tokens,output_tokens``
  plus optional ``request_id``, ``class`` (``online`` / ``offline``, default online) and
  ``priority`` (int, larger first, default 0). :func:`write_requests_jsonl` writes this form.
* **Length-only** files (e.g. vidur's ``arxiv_summarization.csv``:
  ``num_prefill_tokens,num_decode_tokens,...``): offline batch jobs with no timestamps, all queued
  at one arrival time (a backlog).

Rules: a path that is not a regular file or holds more than
:data:`~flexpipe_dag.core.user_files.MAX_TRACE_BYTES` bytes, text that is not UTF-8, an empty file, a
missing column, an unparsable timestamp / arrival (or one later than
:data:`~flexpipe_dag.workload.request.MAX_ARRIVAL_S`, 31 days, after the start), a token count that is not
an integer in ``1..INT32_MAX``, a priority outside ``-INT32_MAX..INT32_MAX`` or a request id longer
than :data:`MAX_REQUEST_ID_CHARS` raise :class:`~flexpipe_dag.core.errors.InputError` with ``source`` =
the file and ``field`` = ``row N.column`` (N counts data rows from 1); unsorted arrivals are sorted
(stable) with a :class:`UserWarning` that says how many rows were out of order. The integer bounds
are what the store's integer columns and numpy ``int64`` arithmetic hold without overflow.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from flexpipe_dag.core.errors import InputError, shown
from flexpipe_dag.core.settings import INT32_MAX, check_number
from flexpipe_dag.workload.files import is_jsonl, read_user_frame
from flexpipe_dag.workload.request import GENERIC_COLUMNS, MAX_ARRIVAL_S, REQUEST_CLASSES, Workload

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
LENGTH_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
#: Longest request id a trace may use (the store's ``request_results.request_key`` is 200 chars).
MAX_REQUEST_ID_CHARS = 200


class UnsortedTraceWarning(UserWarning):
    """A trace's arrivals were not in time order; the loader sorted them."""


#: Columns that hold numbers in every trace form: in JSONL each must be a JSON number, not a string of one.
NUMBER_COLUMNS = ("arrival_s", "input_tokens", "output_tokens", "priority", *AZURE_COLUMNS[1:], *LENGTH_COLUMNS)


def _read_table(path: Path) -> pd.DataFrame:
    """Read CSV or JSONL into a DataFrame (size-capped, :func:`~flexpipe_dag.workload.files.read_user_frame`).

    Raises:
        InputError: the file is empty, or (JSONL) a number column holds a string (``"input_tokens": "10"``):
            JSON has numbers, and a quoted one is refused as the cluster and gear files refuse it (row and
            column named). CSV is text throughout; its columns are parsed as numbers by the loaders.
    """
    frame = read_user_frame(path, "request trace (CSV or JSONL)", skipinitialspace=True)
    if frame.empty:
        raise InputError(str(path), None, "no requests (only a header); expected at least one data row")
    if is_jsonl(path):
        for column in (c for c in NUMBER_COLUMNS if c in frame.columns):
            quoted = frame[column].map(lambda v: isinstance(v, str)).to_numpy(dtype=bool)
            if quoted.any():
                i = int(np.flatnonzero(quoted)[0])
                raise InputError(str(path), _row_field(i, column),
                                 f"got the string {shown(frame[column].iloc[i])}; expected a JSON number")
    return frame


def _require_columns(frame: pd.DataFrame, columns: tuple[str, ...], source: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise InputError(source, missing[0], f"column missing; expected columns {list(columns)}, found {list(frame.columns)}")


def _row_field(idx: int, column: str) -> str:
    return f"row {idx + 1}.{column}"


def to_numeric(values: pd.Series) -> pd.Series:
    """``pd.to_numeric(values, errors="coerce")``, also for integers too large for a float: pandas reads those
    as Python ints and raises OverflowError on them; read from their text they become inf, which every
    caller's range refuses. A boolean (JSON ``true`` / ``false``, a CSV column of ``True`` / ``False``) is no
    number: it becomes NaN, which every caller refuses too (``pd.to_numeric`` would keep it, read as 1 / 0)."""
    values = values.mask(values.map(lambda v: isinstance(v, (bool, np.bool_))).astype(bool))
    try:
        return pd.to_numeric(values, errors="coerce")
    except OverflowError:
        return pd.to_numeric(values.astype(str), errors="coerce")


def token_column(frame: pd.DataFrame, column: str, source: str) -> np.ndarray:
    """``frame[column]`` as int64 token counts, shape ``(len(frame),)``.

    Raises:
        InputError: a value that is not an integer in ``1..INT32_MAX`` (text, empty, a fraction, a boolean),
            named by ``source``, row and column.
    """
    values = to_numeric(frame[column])
    bad = values.isna() | (values < 1) | (values != np.floor(values)) | (values > INT32_MAX)
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise InputError(source, _row_field(i, column),
                         f"got {shown(frame[column].iloc[i])}; expected an integer token count >= 1 and <= {INT32_MAX}")
    return values.to_numpy(dtype=np.int64)


def _sorted_by_arrival(frame: pd.DataFrame, source: str) -> pd.DataFrame:
    t = frame["arrival_s"].to_numpy()
    out_of_order = int(np.count_nonzero(np.diff(t) < 0))
    if out_of_order:
        rows = "1 row arrives before the row above it" if out_of_order == 1 else \
            f"{out_of_order} rows arrive before the row above them"
        warnings.warn(f"{source}: {rows}; sorted by arrival_s",
                      UnsortedTraceWarning, stacklevel=3)
        frame = frame.sort_values("arrival_s", kind="stable").reset_index(drop=True)
    return frame


def _finish(frame: pd.DataFrame, name: str, source: str, meta: dict[str, Any], rebase: bool = False) -> Workload:
    frame = _sorted_by_arrival(frame, source)
    if rebase:
        frame["arrival_s"] = frame["arrival_s"] - float(frame["arrival_s"].iloc[0])
    if frame["request_id"].duplicated().any():
        i = int(np.flatnonzero(frame["request_id"].duplicated().to_numpy())[0])
        raise InputError(source, _row_field(i, "request_id"), f"duplicate id {shown(frame['request_id'].iloc[i])}; expected unique ids")
    return Workload.from_frame(frame[list(GENERIC_COLUMNS)], name=name, source=source, meta=meta)


def load_azure_trace(path: str | Path, *, name: str | None = None, id_prefix: str | None = None) -> Workload:
    """Load an Azure LLM inference 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Every request is ``online``, priority 0, ``arrival_s`` = seconds since the first timestamp
    (nanosecond-exact; the 7th fractional digit is kept). Ids are ``<prefix>-<row>``.

    Raises:
        InputError: empty file, missing column, unparsable timestamp, token count not in ``1..INT32_MAX``.
    """
    path = Path(path)
    source = str(path)
    frame = _read_table(path)
    _require_columns(frame, AZURE_COLUMNS, source)
    # utc=True: a zone offset is honoured (and rows in different zones agree), a timestamp without one is read as UTC
    ts = pd.to_datetime(frame["TIMESTAMP"], format="ISO8601", errors="coerce", utc=True)
    if ts.isna().any():
        i = int(np.flatnonzero(ts.isna().to_numpy())[0])
        raise InputError(source, _row_field(i, "TIMESTAMP"),
                         f"got {shown(frame['TIMESTAMP'].iloc[i])}; expected a timestamp like '2023-11-16 18:15:46.6805900'")
    # in the unit pandas parsed to (ns where a value has 7+ fractional digits, else coarser, so that years outside
    # 1677-2262 are read, not an OutOfBoundsDatetime): ticks since the first request, exact
    stamps = ts.dt.tz_convert(None).to_numpy()
    ticks = stamps.astype(np.int64)
    ticks_per_s = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}[np.datetime_data(stamps.dtype)[0]]
    if (float(ticks.max()) - float(ticks.min())) / ticks_per_s <= MAX_ARRIVAL_S:
        offsets_s = (ticks - ticks.min()) / ticks_per_s  # exact ticks, one rounding
    else:  # centuries apart (int64 differences could wrap): only to find the row that is too late
        offsets_s = (ticks.astype(np.float64) - float(ticks.min())) / ticks_per_s
    late = offsets_s > MAX_ARRIVAL_S
    if late.any():
        i = int(np.flatnonzero(late)[0])
        raise InputError(source, _row_field(i, "TIMESTAMP"), f"got {shown(frame['TIMESTAMP'].iloc[i])}, more than "
                                                             f"{MAX_ARRIVAL_S:.0f} s (31 days) after the first request")
    prefix = id_prefix or path.stem
    out = pd.DataFrame({
        "request_id": [f"{prefix}-{i:06d}" for i in range(len(frame))],
        "arrival_s": offsets_s,
        "input_tokens": token_column(frame, "ContextTokens", source),
        "output_tokens": token_column(frame, "GeneratedTokens", source),
        "class": "online",
        "priority": 0,
    })
    start = ts.min()
    return _finish(out, name or path.stem, source, {"format": "azure-llm-2023", "start_timestamp": str(start)})


def load_request_file(path: str | Path, *, name: str | None = None, rebase: bool = False) -> Workload:
    """Load the generic CSV / JSONL form (see module docstring).

    Args:
        rebase: shift arrivals so the first is at 0 s (default keeps them as written).

    Raises:
        InputError: empty file, missing column, arrival not a finite number >= 0, token count not an
            integer in ``1..INT32_MAX``, class not online/offline, priority not an integer in
            ``-INT32_MAX..INT32_MAX`` (a boolean is no number), request_id empty, over
            :data:`MAX_REQUEST_ID_CHARS` or duplicated.
    """
    path = Path(path)
    source = str(path)
    frame = _read_table(path)
    _require_columns(frame, ("arrival_s", "input_tokens", "output_tokens"), source)
    arrival = to_numeric(frame["arrival_s"])
    bad = arrival.isna() | ~np.isfinite(arrival.fillna(0)) | (arrival < 0) | (arrival > MAX_ARRIVAL_S)
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise InputError(source, _row_field(i, "arrival_s"), f"got {shown(frame['arrival_s'].iloc[i])}; expected "
                                                             f"seconds 0..{MAX_ARRIVAL_S:.0f} (31 days)")
    klass = frame["class"].astype(str).str.strip().str.lower() if "class" in frame.columns else pd.Series("online", index=frame.index)
    bad = ~klass.isin(REQUEST_CLASSES)
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise InputError(source, _row_field(i, "class"), f"got {shown(frame['class'].iloc[i])}; expected one of {list(REQUEST_CLASSES)}")
    if "priority" in frame.columns:
        prio = to_numeric(frame["priority"])
        bad = prio.isna() | (prio != np.floor(prio.fillna(0))) | (prio.abs() > INT32_MAX)
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            raise InputError(source, _row_field(i, "priority"),
                             f"got {shown(frame['priority'].iloc[i])}; expected an integer -{INT32_MAX}..{INT32_MAX}")
        prio = prio.astype(np.int64)
    else:
        prio = pd.Series(0, index=frame.index, dtype=np.int64)
    ids = (frame["request_id"].astype(str) if "request_id" in frame.columns
           else pd.Series([f"{path.stem}-{i:06d}" for i in range(len(frame))]))
    empty = ids.isna() | (ids.str.strip() == "")
    if "request_id" in frame.columns:
        empty |= frame["request_id"].isna()  # pandas < 3 spells a missing id "nan" once cast to str
    if empty.any():  # an empty CSV cell or a JSON null: no id to key the request's result by
        i = int(np.flatnonzero(empty.to_numpy())[0])
        raise InputError(source, _row_field(i, "request_id"),
                         "empty; expected an id on every row (or no request_id column: ids are then generated)")
    too_long = ids.str.len() > MAX_REQUEST_ID_CHARS
    if too_long.any():
        i = int(np.flatnonzero(too_long.to_numpy())[0])
        raise InputError(source, _row_field(i, "request_id"),
                         f"{len(ids.iloc[i])} characters; expected at most {MAX_REQUEST_ID_CHARS}")
    unprintable = ~ids.map(str.isprintable).astype(bool)
    if unprintable.any():
        i = int(np.flatnonzero(unprintable.to_numpy())[0])
        raise InputError(source, _row_field(i, "request_id"),
                         f"got {shown(ids.iloc[i])}; expected printable text (no control or bidirectional characters)")
    out = pd.DataFrame({
        "request_id": ids.to_numpy(),
        "arrival_s": arrival.to_numpy(dtype=float),
        "input_tokens": token_column(frame, "input_tokens", source),
        "output_tokens": token_column(frame, "output_tokens", source),
        "class": klass.to_numpy(),
        "priority": prio.to_numpy(),
    })
    return _finish(out, name or path.stem, source, {"format": "generic"}, rebase=rebase)


def load_length_file(
    path: str | Path,
    *,
    name: str | None = None,
    arrival_s: float = 0.0,
    limit: int | None = None,
    priority: int = 0,
    id_prefix: str | None = None,
) -> Workload:
    """Offline batch jobs from a length-only file (``num_prefill_tokens,num_decode_tokens,...``).

    Every row becomes an ``offline`` request queued at ``arrival_s`` (a backlog), in file order.

    Args:
        limit: keep only the first ``limit`` rows.

    Raises:
        InputError: empty file, missing column, token count outside ``1..INT32_MAX``, ``arrival_s`` not
            a finite number >= 0, ``limit`` not an integer >= 1, ``priority`` not an integer in range.
    """
    path = Path(path)
    source = str(path)
    check_number(arrival_s, source, "arrival_s", ge=0, unit="seconds")
    if limit is not None:
        check_number(limit, source, "limit", integer=True, ge=1, le=INT32_MAX)
    check_number(priority, source, "priority", integer=True, ge=-INT32_MAX, le=INT32_MAX)
    frame = _read_table(path)
    _require_columns(frame, LENGTH_COLUMNS, source)
    if limit is not None:
        frame = frame.iloc[:limit].reset_index(drop=True)
    prefix = id_prefix or path.stem
    out = pd.DataFrame({
        "request_id": [f"{prefix}-{i:06d}" for i in range(len(frame))],
        "arrival_s": float(arrival_s),
        "input_tokens": token_column(frame, "num_prefill_tokens", source),
        "output_tokens": token_column(frame, "num_decode_tokens", source),
        "class": "offline",
        "priority": int(priority),
    })
    return _finish(out, name or path.stem, source, {"format": "length-only"})
