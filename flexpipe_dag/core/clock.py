"""Instants read back from the store: SQLite returns a ``DateTime(timezone=True)`` column naive (its UTC value),
PostgreSQL aware; these read both alike."""

from __future__ import annotations

import datetime as dt


def as_utc(when: dt.datetime) -> dt.datetime:
    """``when`` with its time zone: a naive datetime (SQLite gives ``DateTime(timezone=True)`` back naive) is UTC."""
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def epoch_s(when: dt.datetime | None) -> int | None:
    """``when`` as whole Unix seconds (a naive one read as UTC); None for None."""
    return int(as_utc(when).timestamp()) if when is not None else None
