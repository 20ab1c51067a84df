"""The one session helper every part of the store shares, and small value helpers for writes."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, overload

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import InstrumentedAttribute, Session, sessionmaker

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.sql.engine import IMMEDIATE


class StoreBase:
    """A session factory over one engine: the base of every concern class of the store.

    Each concern class (:class:`~flexpipe_dag.sql.profiles.Profiles`, ...) reads and writes its own
    tables through :meth:`session`; :class:`~flexpipe_dag.sql.store.Store` combines them over one
    engine. A concern class can also be used alone (``Profiles(engine)``); nothing here migrates.

    Args:
        engine: an SQLAlchemy engine (see :func:`~flexpipe_dag.sql.engine.make_engine`).
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        # BEGIN IMMEDIATE on SQLite: a session that reads, then writes, never meets a write committed in
        # between (which SQLite would refuse at once with "database is locked", whatever the busy timeout)
        self._sessions = sessionmaker(engine.execution_options(**IMMEDIATE), expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on any error.

        On SQLite the transaction takes the write lock when it begins (``BEGIN IMMEDIATE``; other sessions
        wait, up to the busy timeout, and plain readers are not blocked in WAL mode), so a write that reads
        first, e.g. the next version number (:func:`next_number`), is race-free across threads and processes.
        """
        with self._sessions.begin() as s:
            yield s


def next_number(s: Session, column: InstrumentedAttribute[int], parent: Any, *criteria: Any) -> int:
    """The next version number: 1 + the largest ``column`` among rows matching ``criteria`` (1 when none).

    Race-free in a :meth:`StoreBase.session`: on SQLite that holds the write lock; on PostgreSQL the
    ``parent`` row (the ORM object the versions belong to, e.g. the cluster) is locked ``FOR UPDATE``
    first, so concurrent writers of the same parent take turns.
    """
    if s.get_bind().dialect.name != "sqlite":
        s.refresh(parent, with_for_update=True)
    return int(s.scalar(select(func.max(column)).where(*criteria)) or 0) + 1


def finite_or_none(x: float | None) -> float | None:
    """``None`` for an infinite value (stored as NULL = unbounded), else ``x``."""
    return None if x is None or math.isinf(x) else x


def json_ready(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` made JSON-safe (values JSON cannot hold become strings), as a fresh dict."""
    return json.loads(json.dumps(doc, default=str))


def _shown(value: Any) -> str:
    """``value`` as an error message shows it (a numpy float as the plain float it holds)."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return repr(float(value))
    return repr(value)


@overload
def checked_int(value: Any, where: str, field: str, *, optional: Literal[False] = False,
                context: str = "") -> int: ...
@overload
def checked_int(value: Any, where: str, field: str, *, optional: bool, context: str = "") -> int | None: ...
def checked_int(value: Any, where: str, field: str, *, optional: bool = False, context: str = "") -> int | None:
    """``value`` as a plain ``int`` (an ``int``, a numpy integer or a float holding a whole number).

    Raises:
        InputError: ``where`` and ``field`` named; ``value`` is not a whole number (a bool is not one either),
            or it is None and not ``optional``; ``context`` is appended to the message.
    """
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
            return int(float(value))
    raise InputError(where, field, f"expected an integer{' or None' if optional else ''}, got {_shown(value)}"
                     + context)


@overload
def checked_finite(value: Any, where: str, field: str, *, optional: Literal[False] = False,
                   context: str = "") -> float: ...
@overload
def checked_finite(value: Any, where: str, field: str, *, optional: bool, context: str = "") -> float | None: ...
def checked_finite(value: Any, where: str, field: str, *, optional: bool = False, context: str = "") -> float | None:
    """``value`` as a plain finite ``float`` (None passes when ``optional``: None, not NaN, says "no value").

    Raises:
        InputError: ``where`` and ``field`` named; ``value`` is NaN, infinite or not a number (a bool is not
            one either), or it is None and not ``optional``; ``context`` is appended to the message.
    """
    if value is None and optional:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise InputError(where, field, f"expected a finite number{' or None' if optional else ''}, got {_shown(value)}"
                     + context)


def checked_text(value: Any, where: str, field: str, max_length: int, *, optional: bool = False) -> str | None:
    """``value`` if it is a string of at most ``max_length`` characters (the column's length: PostgreSQL refuses a
    longer one, SQLite would keep it), or None when ``optional``.

    Raises:
        InputError: ``where`` and ``field`` named; ``value`` is not such a string.
    """
    if (value is None and optional) or (isinstance(value, str) and len(value) <= max_length):
        return value
    shown = f"{len(value)} characters" if isinstance(value, str) else _shown(value)
    raise InputError(where, field, f"expected a string of at most {max_length} characters"
                     f"{' or None' if optional else ''}, got {shown}")


def get_or_insert(s: Session, model: type[Any], **key: Any) -> Any:
    """The row of ``model`` with these unique ``key`` values, inserted first when absent.

    The insert is ``ON CONFLICT DO NOTHING`` (SQLite and PostgreSQL), so two writers creating the same
    row at once both get it instead of one failing on the unique constraint.
    """
    from sqlalchemy.dialects import postgresql, sqlite

    insert: Any = postgresql.insert if s.get_bind().dialect.name == "postgresql" else sqlite.insert
    row = s.scalar(select(model).filter_by(**key))
    if row is None:
        s.execute(insert(model).values(**key).on_conflict_do_nothing(index_elements=list(key)))
        row = s.scalar(select(model).filter_by(**key))
    return row
