"""The one session helper every part of the store shares, and small value helpers for writes."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker


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
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on any error."""
        with self._sessions.begin() as s:
            yield s


def finite_or_none(x: float | None) -> float | None:
    """``None`` for an infinite value (stored as NULL = unbounded), else ``x``."""
    return None if x is None or math.isinf(x) else x


def json_ready(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` made JSON-safe (values JSON cannot hold become strings), as a fresh dict."""
    return json.loads(json.dumps(doc, default=str))
