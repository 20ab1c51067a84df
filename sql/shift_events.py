"""Shift events in the store: controller decisions and how each shift went.

The table doubles as the message channel between the ``gear_shift`` Dagster job and the process
serving the pipeline: the job marks an event ``requested`` (:meth:`ShiftEvents.request_shift`), addressed
to the serving run the decision was taken on (``run_key``) and with a deadline (``expires_at``); that
serving run, and no other, picks it up (:meth:`ShiftEvents.pending_shift_requests`), takes it
(:meth:`ShiftEvents.claim_shift_request`: ``applying``), applies it and marks it ``done``,
``rolled_back`` or ``failed``; the job polls the event (:meth:`ShiftEvents.get_shift_event`) until then.
A request nobody took before its deadline becomes ``expired`` (:meth:`ShiftEvents.expire_shift_requests`).
Every status change of the protocol is a compare-and-set, so a retried or re-executed run never moves an
event backwards. One decision is one row: :meth:`ShiftEvents.record_shift_event` with a ``decision_key``
already stored returns that row.
"""

from __future__ import annotations

import datetime as dt
import math
import numbers
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from flexpipe_dag.core.clock import as_utc
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.status import ShiftEventAction, ShiftEventStatus, checked
from flexpipe_dag.sql import models as m
from flexpipe_dag.sql.models import utcnow
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


def _stored_event(s: Session, event_id: int) -> m.ShiftEvent:
    """Event ``event_id`` in session ``s``.

    Raises:
        KeyError: ``event_id`` is not stored.
    """
    ev = s.get(m.ShiftEvent, event_id)
    if ev is None:
        raise KeyError(event_id)
    return ev


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
                           run_key: str | None = None, details: dict[str, Any] | None = None,
                           decision_key: str | None = None) -> int:
        """Record a controller decision or a shift's outcome; return the event id.

        ``run_key`` is the serving run the decision was taken on (a shift is addressed to it).
        ``decision_key`` is the decision's deterministic key (a shift's ``gear_shift`` run key): when an
        event with that key is stored, nothing is written and its id is returned, so a retried evaluation
        stores one row per decision.

        ``est_gain`` and ``migration_cost_s`` are None when not estimated and inf when unbounded (both
        stored as NULL); NaN is neither, and is refused.

        Raises:
            InputError: ``shift_events`` and the field named, nothing written: an ``action`` or ``status``
                outside its enum, a ``reason`` that is not a string, a NaN or non-numeric ``est_gain`` or
                ``migration_cost_s``, or a gear key, run key or decision key over 200 characters (``trigger``: 40).
        """
        where = "shift_events"
        action = checked(ShiftEventAction, action, where, "action").value
        status = checked(ShiftEventStatus, status, where, "status").value
        if not isinstance(reason, str):
            raise InputError(where, "reason", f"expected a string, got {reason!r}")
        for name, value, length in (("from_gear_key", from_gear_key, 200), ("to_gear_key", to_gear_key, 200),
                                    ("trigger", trigger, 40), ("run_key", run_key, 200),
                                    ("decision_key", decision_key, 200)):
            checked_text(value, where, name, length, optional=True)
        ev = m.ShiftEvent(action=action, status=status, reason=reason, from_gear_key=from_gear_key,
                          to_gear_key=to_gear_key, trigger=trigger, est_gain=_unbounded_or_finite(est_gain, "est_gain"),
                          migration_cost_s=_unbounded_or_finite(migration_cost_s, "migration_cost_s"),
                          run_key=run_key, details=json_ready(details or {}), decision_key=decision_key)
        try:
            with self.session() as s:
                if decision_key is not None and (known := self._keyed_event_id(s, decision_key)) is not None:
                    return known
                s.add(ev)
                s.flush()
                return ev.id
        except IntegrityError:  # another writer stored the same decision in between (PostgreSQL)
            with self.session() as s:
                known = self._keyed_event_id(s, decision_key) if decision_key is not None else None
            if known is None:
                raise
            return known

    @staticmethod
    def _keyed_event_id(s: Any, decision_key: str) -> int | None:
        return s.scalar(select(m.ShiftEvent.id).where(m.ShiftEvent.decision_key == decision_key))

    def _moved(self, event_id: int, allowed: Sequence[str], status: str, details: dict[str, Any] | None,
               **columns: Any) -> tuple[bool, m.ShiftEvent]:
        """Set ``status`` (and ``columns``, merging ``details``) only when the event is in one of ``allowed``;
        ``(moved, the event as stored after)``.

        Raises:
            KeyError: ``event_id`` is not stored.
        """
        with self.session() as s:
            ev = _stored_event(s, event_id)
            if ev.status not in allowed:
                return False, ev
            ev.status = status
            for name, value in columns.items():
                setattr(ev, name, value)
            if details:
                ev.details = {**ev.details, **json_ready(details)}
            return True, ev

    def request_shift(self, event_id: int, run_key: str, deadline_s: float,
                      details: dict[str, Any] | None = None) -> tuple[bool, m.ShiftEvent]:
        """Ask serving run ``run_key`` to make the decided shift ``event_id`` within ``deadline_s`` seconds.

        Only a ``decided`` event moves (to ``requested``, addressed to ``run_key``, ``expires_at`` set, ``details``
        merged); any other is left as it is.

        Returns:
            ``(moved, the event as stored after)``.

        Raises:
            KeyError: ``event_id`` is not stored.
            InputError: ``run_key`` is not a string of at most 200 characters, or ``deadline_s`` is not a finite
                number > 0 (``shift_events`` and the field named).
        """
        checked_text(run_key, "shift_events", "run_key", 200)
        if not (isinstance(deadline_s, numbers.Real) and math.isfinite(deadline_s) and deadline_s > 0):
            raise InputError("shift_events", "deadline_s", f"expected a finite number of seconds > 0, got {deadline_s!r}")
        return self._moved(event_id, (ShiftEventStatus.DECIDED.value,), ShiftEventStatus.REQUESTED.value, details,
                           run_key=run_key, expires_at=utcnow() + dt.timedelta(seconds=float(deadline_s)))

    def claim_shift_request(self, event_id: int, run_key: str, details: dict[str, Any] | None = None) -> bool:
        """Serving run ``run_key`` takes the shift ``event_id`` (``applying``): True only when it was ``requested``,
        addressed to ``run_key`` and not past its deadline, or ``decided`` on ``run_key``'s own samples (the serve
        loop's inline control); False leaves the event as it is.

        Raises:
            KeyError: ``event_id`` is not stored.
        """
        with self.session() as s:
            ev = _stored_event(s, event_id)
            if ev.run_key != run_key or ev.status not in (ShiftEventStatus.REQUESTED, ShiftEventStatus.DECIDED):
                return False
            if ev.expires_at is not None and as_utc(ev.expires_at) <= utcnow():
                return False
            ev.status = ShiftEventStatus.APPLYING.value
            if details:
                ev.details = {**ev.details, **json_ready(details)}
            return True

    def expire_shift_requests(self, event_id: int | None = None) -> list[int]:
        """Mark ``requested`` events past their deadline ``expired`` (only ``event_id`` when given); their ids.

        The stored ``error`` says no live serving run took the shift by its deadline.
        """
        now = utcnow()
        with self.session() as s:
            q = select(m.ShiftEvent).where(m.ShiftEvent.status == ShiftEventStatus.REQUESTED.value,
                                           m.ShiftEvent.expires_at.is_not(None))
            if event_id is not None:
                q = q.where(m.ShiftEvent.id == event_id)
            expired = []
            for ev in s.scalars(q):
                if ev.expires_at is None or (deadline := as_utc(ev.expires_at)) > now:
                    continue
                ev.status = ShiftEventStatus.EXPIRED.value
                ev.details = {**ev.details, "error": f"no live serving run took the shift by its deadline "
                                                     f"{deadline.isoformat(timespec='seconds')} (addressed to run "
                                                     f"{ev.run_key})"}
                expired.append(ev.id)
            return expired

    def update_shift_event(self, event_id: int, status: str, details: dict[str, Any] | None = None) -> None:
        """Set an event's status and merge ``details`` into its details."""
        status = checked(ShiftEventStatus, status, "shift_events", "status").value
        with self.session() as s:
            ev = _stored_event(s, event_id)
            ev.status = status
            if details:
                ev.details = {**ev.details, **json_ready(details)}

    def get_shift_event(self, event_id: int) -> m.ShiftEvent:
        """One event, as stored now."""
        with self.session() as s:
            ev = _stored_event(s, event_id)
            return ev

    def pending_shift_requests(self, run_key: str | None = None) -> list[m.ShiftEvent]:
        """Shifts a Dagster run asked a live pipeline to make (status ``requested``, not past their deadline),
        oldest first; with ``run_key``, only those addressed to that serving run."""
        now = utcnow()
        with self.session() as s:
            q = select(m.ShiftEvent).where(m.ShiftEvent.status == ShiftEventStatus.REQUESTED.value)
            if run_key is not None:
                q = q.where(m.ShiftEvent.run_key == run_key)
            return [ev for ev in s.scalars(q.order_by(m.ShiftEvent.id))
                    if ev.expires_at is None or as_utc(ev.expires_at) > now]

    def shift_events(self, limit: int | None = None, run_key: str | None = None) -> list[m.ShiftEvent]:
        """Events, oldest first (the first ``limit`` of them when given; only ``run_key``'s when given)."""
        with self.session() as s:
            q = select(m.ShiftEvent).order_by(m.ShiftEvent.id)
            if run_key is not None:
                q = q.where(m.ShiftEvent.run_key == run_key)
            if limit is not None:
                q = q.limit(limit)
            return list(s.scalars(q))
