"""The gear-shift controller's cursor: its state, the last metric-sample row read and the run followed, as JSON.

The ``gear_shift_sensor`` keeps it as its Dagster cursor and the serve loop in memory; both go through
:func:`flexpipe_dag.control.service.evaluate_gear_shift`, which reads and writes it with these two
functions.
"""

from __future__ import annotations

import json

from flexpipe_dag.control.state import ControllerState
from flexpipe_dag.core.errors import InputError


def parse_cursor(cursor: str | None) -> tuple[ControllerState | None, int | None, str | None]:
    """``(controller state, last metric-sample row id, run followed)`` from a cursor ((None, None, None) when empty).

    Raises:
        InputError: the cursor is not one :func:`make_cursor` wrote (named "gear_shift_sensor cursor").
    """
    if not cursor:
        return None, None, None
    try:
        doc = json.loads(cursor)
        state = ControllerState.from_cursor(doc["controller"]) if doc.get("controller") else None
        return state, doc.get("last_sample_id"), doc.get("run_key")
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError("gear_shift_sensor cursor", None, f"cannot parse: {exc}") from None


def make_cursor(state: ControllerState | None, last_sample_id: int | None, run_key: str | None = None) -> str:
    """The cursor :func:`parse_cursor` reads back: sorted-key JSON of the state, the row id and the run key."""
    return json.dumps({"controller": state.to_cursor() if state else None, "last_sample_id": last_sample_id,
                       "run_key": run_key}, sort_keys=True)
