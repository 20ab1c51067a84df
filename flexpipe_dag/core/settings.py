"""Where FlexPipe keeps its state, from the environment.

* ``FLEXPIPE_HOME``: directory for the embedded SQLite store, cached model conversions and reports
  (default ``~/.flexpipe``).
* ``FLEXPIPE_MODEL_CACHE``: where converted model checkpoints are cached (default
  ``$FLEXPIPE_HOME/models``); several homes (e.g. test runs) can share one.
* ``FLEXPIPE_DATABASE_URL``: an SQLAlchemy URL (e.g. ``postgresql+psycopg2://user@host/db``); when
  set, the store uses it instead of SQLite.

Numeric and boolean knobs (``FLEXPIPE_DWELL_S``, ``FLEXPIPE_PROBE``, ``FLEXPIPE_PLAN_CONCURRENCY``, ...)
are read with :func:`env_value`, which refuses a value of the wrong type or out of range with an
:class:`~flexpipe_dag.core.errors.InputError` naming the variable and what was expected, so a bad
environment fails once, clearly, where it is read (e.g. when the Dagster code location loads).
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path
from typing import TypeVar, overload

from flexpipe_dag.core.errors import InputError

#: Largest integer a 32-bit SQL ``INTEGER`` column (PostgreSQL), a numpy ``int32`` or a torch index
#: holds. Token counts, priorities and other counts read from user files are bounded by it, so an
#: absurd value (``10**30``) is refused where it is read instead of overflowing in the store.
INT32_MAX = 2**31 - 1
#: Largest integer SQLite's ``INTEGER`` / PostgreSQL's ``BIGINT`` holds.
INT64_MAX = 2**63 - 1

#: Spellings :func:`env_value` accepts for booleans (case-insensitive).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

_T = TypeVar("_T", int, float, bool)


def flexpipe_home() -> Path:
    """The FlexPipe home directory (created if missing).

    Raises:
        InputError: it is not a directory and cannot be made one (a file of that name, no permission),
            naming ``FLEXPIPE_HOME`` and the path.
    """
    home = Path(os.environ.get("FLEXPIPE_HOME") or Path.home() / ".flexpipe").expanduser()
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError("environment variable FLEXPIPE_HOME", None,
                         f"cannot use {str(home)!r} as the FlexPipe home ({exc.strerror or type(exc).__name__}); "
                         "expected a directory FlexPipe can create or write") from None
    return home


def _home_sqlite_url() -> str:
    return f"sqlite:///{flexpipe_home() / 'flexpipe.db'}"


#: Metric samples are kept this many days by default (``flexpipe store prune``, the ``store_retention`` schedule).
DEFAULT_SAMPLE_RETENTION_DAYS = 14.0
#: The environment variable that sets the retention, days.
SAMPLE_RETENTION_VAR = "FLEXPIPE_SAMPLE_RETENTION_DAYS"
#: The shortest retention accepted, seconds: the controller's windows (recent peak, smoothing, the freshness bound)
#: and a serving run's own report read the last minutes to hours of samples.
MIN_SAMPLE_RETENTION_S = 3600.0
#: The longest retention accepted, days (a typo guard: ten years).
MAX_SAMPLE_RETENTION_DAYS = 3650.0


def sample_retention_s(keep_days: float | None = None, field: str = "--keep-days") -> float:
    """The metric-sample retention in seconds: ``keep_days`` (days) when given, else ``FLEXPIPE_SAMPLE_RETENTION_DAYS``,
    else :data:`DEFAULT_SAMPLE_RETENTION_DAYS`.

    Raises:
        InputError: naming ``field`` (or the variable): not a finite number of days from 1 hour
            (:data:`MIN_SAMPLE_RETENTION_S`) to :data:`MAX_SAMPLE_RETENTION_DAYS`.
    """
    low = MIN_SAMPLE_RETENTION_S / 86400
    if keep_days is None:
        keep_days = env_value(SAMPLE_RETENTION_VAR, float, DEFAULT_SAMPLE_RETENTION_DAYS, ge=low,
                              le=MAX_SAMPLE_RETENTION_DAYS, unit="days")
    else:
        check_number(keep_days, None, field, ge=low, le=MAX_SAMPLE_RETENTION_DAYS, unit="days")
    return float(keep_days) * 86400


def database_url() -> str:
    """The store's SQLAlchemy URL: ``FLEXPIPE_DATABASE_URL`` or SQLite under :func:`flexpipe_home`."""
    return os.environ.get("FLEXPIPE_DATABASE_URL") or _home_sqlite_url()


def database_url_source(url: str | None) -> str:
    """What a message about the store at ``url`` names as its origin: ``FLEXPIPE_DATABASE_URL``, except
    for the SQLite store under :func:`flexpipe_home` while that variable is unset (``FLEXPIPE_HOME``'s)."""
    if url is not None and not os.environ.get("FLEXPIPE_DATABASE_URL") and url == _home_sqlite_url():
        return "the store under FLEXPIPE_HOME"
    return "FLEXPIPE_DATABASE_URL"


def model_cache_dir() -> Path:
    """Directory of converted model checkpoints (``FLEXPIPE_MODEL_CACHE`` or ``$FLEXPIPE_HOME/models``)."""
    path = Path(os.environ.get("FLEXPIPE_MODEL_CACHE") or flexpipe_home() / "models").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _range_text(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    parts = [f"{op} {v:g}" if isinstance(v, float) else f"{op} {v}"
             for op, v in ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if v is not None]
    return " and ".join(parts)


def parse_setting(raw: str, kind: type[_T], source: str, field: str | None = None, *, ge: float | None = None,
                  gt: float | None = None, le: float | None = None, lt: float | None = None, unit: str = "") -> _T:
    """Parse one textual setting (an environment value, a config string) as ``kind`` within a range.

    Args:
        raw: the text as given (surrounding whitespace is ignored).
        kind: ``int``, ``float`` or ``bool``. Booleans accept ``1/0``, ``true/false``, ``yes/no``,
            ``on/off`` (any case); integers must be written as integers (``"3.5"`` and ``"1e3"`` are
            refused); floats must be finite.
        source, field: named in the error (e.g. ``"environment variable FLEXPIPE_DWELL_S"``).
        ge, gt, le, lt: inclusive / exclusive bounds (integers are also capped at :data:`INT64_MAX`).
        unit: appended to the expectation in the message, e.g. ``"seconds"``.

    Raises:
        InputError: the text is not a ``kind`` or is out of range; the message names ``source`` /
            ``field``, the expected type and range, and the value given.
    """
    text = raw.strip()
    if kind is bool:
        low = text.lower()
        if low in TRUE_WORDS:
            return True
        if low in FALSE_WORDS:
            return False
        raise InputError(source, field, f"expected a boolean ({'/'.join(TRUE_WORDS[:2])} or "
                                        f"{'/'.join(FALSE_WORDS[:2])}), got {raw!r}")
    value: int | float | None = None
    if kind is int:
        what = "an integer"
        try:
            value = int(text, 10)
        except ValueError:
            pass
    elif kind is float:
        what = "a number"
        try:
            value = float(text)
        except ValueError:
            pass
        if value is not None and not math.isfinite(value):
            value = None
    else:  # pragma: no cover - programming error
        raise TypeError(f"parse_setting: unsupported kind {kind!r}")
    if kind is int and value is not None and value > INT64_MAX and (le is None or le > INT64_MAX):
        le = INT64_MAX
    expected = " ".join(p for p in (what, _range_text(ge, gt, le, lt), f"({unit})" if unit else "") if p)
    shown = raw if len(raw) <= 40 else raw[:37] + "..."
    if value is None:
        raise InputError(source, field, f"expected {expected}, got {shown!r}")
    if ((ge is not None and value < ge) or (gt is not None and value <= gt) or (le is not None and value > le)
            or (lt is not None and value >= lt)):
        raise InputError(source, field, f"expected {expected}, got {shown!r}")
    return kind(value)


@overload
def env_value(name: str, kind: type[_T], default: _T, *, ge: float | None = None, gt: float | None = None,
              le: float | None = None, lt: float | None = None, unit: str = "") -> _T: ...


@overload
def env_value(name: str, kind: type[_T], default: None = None, *, ge: float | None = None,
              gt: float | None = None, le: float | None = None, lt: float | None = None,
              unit: str = "") -> _T | None: ...


def env_value(name: str, kind: type[_T], default: _T | None = None, *, ge: float | None = None,
              gt: float | None = None, le: float | None = None, lt: float | None = None,
              unit: str = "") -> _T | None:
    """The environment variable ``name`` parsed as ``kind`` (see :func:`parse_setting`), or ``default``.

    Unset or blank (only whitespace) means ``default``, which is returned as given (not checked).

    Raises:
        InputError: ``environment variable NAME: expected <type> <range>, got '<value>'``.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    return parse_setting(raw, kind, f"environment variable {name}", None, ge=ge, gt=gt, le=le, lt=lt, unit=unit)


def check_number(value: float | int, source: str | None, field: str | None, *, integer: bool = False,
                 ge: float | None = None, gt: float | None = None, le: float | None = None,
                 lt: float | None = None, unit: str = "", finite: bool = True) -> None:
    """Check an already-parsed number (a command-line flag, a config field) is finite and in range.

    Args:
        value: the number as given (argparse, JSON, YAML).
        source, field: named in the error, e.g. ``(None, "--offline-limit")`` or ``("config.json", "head_dim")``.
        integer: the value must be an integer (``bool`` is refused); integers are also capped at
            :data:`INT64_MAX` when ``le`` is not given.
        ge, gt, le, lt: inclusive / exclusive bounds; ``unit`` is appended to the expectation.
        finite: refuse infinities too (NaN is always refused).

    Raises:
        InputError: ``source: field: expected <an integer | a number> <range> (<unit>), got <value>``.
    """
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if integer and is_number and isinstance(value, numbers.Integral) and value > INT64_MAX and le is None:
        le = INT64_MAX
    what = "an integer" if integer else ("a finite number" if finite else "a number")
    expected = " ".join(p for p in (what, _range_text(ge, gt, le, lt), f"({unit})" if unit else "") if p)
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if not is_number or (integer and not isinstance(value, numbers.Integral)):
        raise InputError(source, field, f"expected {expected}, got {shown}")
    if not isinstance(value, numbers.Integral) and (math.isnan(value) or (finite and math.isinf(value))):
        raise InputError(source, field, f"expected {expected}, got {shown}")
    if ((ge is not None and value < ge) or (gt is not None and value <= gt) or (le is not None and value > le)
            or (lt is not None and value >= lt)):
        raise InputError(source, field, f"expected {expected}, got {shown}")
