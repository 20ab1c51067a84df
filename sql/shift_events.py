"""Shift events in the store: controller decisions and how each shift went.

The table doubles as the message channel between the ``gear_shift`` Dagster job and the process
serving the pipeline: the job marks an event ``requested``; the serving process picks it up
(:meth:`ShiftEvents.pending_shift_requests`), applies it and marks it ``done``, ``rolled_back`` or
``failed``; the job polls the event (:meth:`ShiftEvents.get_shift_event`) until then.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from sqlalchemy import select

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.status import ShiftEventAction, ShiftEventStatus, checked
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.session import StoreBase, checked_text, json_ready


def _unbounded_or_finite(value: Any, field: str) -> float | None:
    """``value`` as stored: None for None or an infinity (unbounded), else a plain finite float.

    Raises:
        InputError: ``shift_events`` and ``field`` named; ``value`` is NaN or not a number.
    """
    if value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isinf(value)):
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value):
        return float(value)
    shown = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value
    raise InputError("shift_events", field,
                     f"expected a number (inf: unbounded, stored as NULL) or None, got {shown!r}")


class ShiftEvents(StoreBase):
    """Controller decisions, taken or declined, and the outcome of each shift (table ``shift_events``).

    Raises:
        InputError: a write with an ``action`` that is not a
            :class:`~flexpipe_dag.core.status.ShiftEventAction` or a ``status`` that is not a
            :class:`~flexpipe_dag.core.status.ShiftEventStatus`, or an event field
            :meth:`record_shift_event` refuses (nothing is written).
        KeyError: an update or read of an event id that is not stored.
    """

    def record_shift_event(self, action: str, status: str, reason: str, *, from_gear_key: str | None = None,
                           to_gear_key: str | None = None, trigger: str | None = None,
                           est_gain: float | None = None, migration_cost_s: float | None = None,
                           run_key: str | None = None, details: dict[str, Any] | None = None) -> int:
        """Record a controller decision or a shift's outcome; return the event id.

        ``est_gain`` and ``migration_cost_s`` are None when not estimated and inf when unbounded (both
        stored as NULL); NaN is neither, and is refused.

        Raises:
            InputError: ``shift_events`` and the field named, nothing written: an ``action`` or ``status``
                outside its enum, a ``reason`` that is not a string, a NaN or non-numeric ``est_gain`` or
                ``migration_cost_s``, or a gear key or run key over 200 characters (``trigger``: 40).
        """
        where = "shift_events"
        action = checked(ShiftEventAction, action, where, "action").value
        status = checked(ShiftEventStatus, status, where, "status").value
        if not isinstance(reason, str):
            raise InputError(where, "reason", f"expected a string, got {reason!r}")
        for name, value, length in (("from_gear_key", from_gear_key, 200), ("to_gear_key", to_gear_key, 200),
                                    ("trigger", trigger, 40), ("run_key", run_key, 200)):
            checked_text(value, where, name, length, optional=True)
        with self.session() as s:
            ev = m.ShiftEvent(action=action, status=status, reason=reason, from_gear_key=from_gear_key,
                              to_gear_key=to_gear_key, trigger=trigger,
                              est_gain=_unbounded_or_finite(est_gain, "est_gain"),
                              migration_cost_s=_unbounded_or_finite(migration_cost_s, "migration_cost_s"),
                              run_key=run_key, details=json_ready(details or {}))
            s.add(ev)
            s.flush()
            return ev.id

    def update_shift_event(self, event_id: int, status: str, details: dict[str, Any] | None = None) -> None:
        """Set an event's status and merge ``details`` into its details."""
        status = checked(ShiftEventStatus, status, "shift_events", "status").value
        with self.session() as s:
            ev = s.get(m.ShiftEvent, event_id)
            if ev is None:
                raise KeyError(event_id)
            ev.status = status
            if details:
                ev.details = {**ev.details, **json_ready(details)}

    def get_shift_event(self, event_id: int) -> m.ShiftEvent:
        """One event, as stored now."""
        with self.session() as s:
            ev = s.get(m.ShiftEvent, event_id)
            if ev is None:
                raise KeyError(event_id)
            return ev

    def pending_shift_requests(self) -> list[m.ShiftEvent]:
        """Shifts a Dagster run asked the live pipeline to make (status ``requested``), oldest first."""
        with self.session() as s:
            return list(s.scalars(select(m.ShiftEvent).where(m.ShiftEvent.status == ShiftEventStatus.REQUESTED.value)
                                  .order_by(m.ShiftEvent.id)))

    def shift_events(self, limit: int | None = None) -> list[m.ShiftEvent]:
        """Events, oldest first (the first ``limit`` of them when given)."""
        with self.session() as s:
            q = select(m.ShiftEvent).order_by(m.ShiftEvent.id)
            if limit is not None:
                q = q.limit(limit)
            return list(s.scalars(q))
