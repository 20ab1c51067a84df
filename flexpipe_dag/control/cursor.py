"""Sensor cursors as JSON: the gear-shift controller's (its state, the last metric-sample row read and
the run followed) and the tide sensor's (:class:`TideCursor`).

The ``gear_shift_sensor`` keeps it as its Dagster cursor and the serve loop in memory; both go through
:func:`flexpipe_dag.control.service.evaluate_gear_shift`, which reads and writes it with these two
functions.
"""

from __future__ import annotations

import json
from typing import Annotated, NamedTuple

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from flexpipe_dag.control.state import TRIGGER_PRIORITY, ControllerState
from flexpipe_dag.control.tide import TideGate
from flexpipe_dag.core.errors import InputError


class GearShiftCursor(NamedTuple):
    """The gear-shift cursor's fields (see :func:`make_cursor`)."""

    state: ControllerState | None
    last_sample_id: int | None
    run_key: str | None
    raised_by: str | None = None
    #: ``(signature, t_s)`` of the last declined decision stored for the run (:func:`decline_signature`).
    last_decline: tuple[str, float] | None = None


def decline_signature(trigger: str | None, reason_kind: str | None, from_gear_id: str | None,
                      to_gear_id: str | None) -> str:
    """What makes two declined decisions alike: ``<trigger>|<reason kind>|<from>-><to>``."""
    return f"{trigger}|{reason_kind}|{from_gear_id}->{to_gear_id}"


#: The largest row id a cursor may hold (SQL's 64-bit integer).
MAX_ROW_ID = 2**63 - 1
RowId = Annotated[StrictInt, Field(ge=0, le=MAX_ROW_ID)]


class _GearShiftCursorDoc(BaseModel):
    """The gear-shift cursor's JSON, typed strictly: a row id is an integer >= 0 (not a boolean, string or float)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    controller: StrictStr | None = None
    last_sample_id: RowId | None = None
    run_key: StrictStr | None = None
    raised_by: StrictStr | None = None
    last_decline: tuple[StrictStr, Annotated[float, Field(allow_inf_nan=False)]] | None = None


def _first_error(err: ValidationError) -> tuple[str | None, str]:
    """``(field path, message)`` of a validation error's first entry."""
    first = err.errors()[0]
    return ".".join(str(p) for p in first["loc"]) or None, first["msg"]


def read_gear_shift_cursor(cursor: str | None) -> GearShiftCursor:
    """Every field of a cursor :func:`make_cursor` wrote (all None when empty).

    Raises:
        InputError: the cursor is not one :func:`make_cursor` wrote: not JSON, nested too deep, or a field of
            the wrong type or range (named; "gear_shift_sensor cursor").
    """
    if not cursor:
        return GearShiftCursor(None, None, None)
    where = "gear_shift_sensor cursor"
    try:
        doc = _GearShiftCursorDoc.model_validate_json(cursor)
    except ValidationError as err:
        field, msg = _first_error(err)
        raise InputError(where, field, f"cannot parse: {msg}") from None
    except (ValueError, RecursionError) as exc:
        raise InputError(where, None, f"cannot parse: {exc}") from None
    if doc.raised_by is not None and doc.raised_by not in TRIGGER_PRIORITY:
        raise InputError(where, "raised_by", f"{doc.raised_by!r} is not a trigger")
    try:
        state = ControllerState.from_cursor(doc.controller) if doc.controller else None
    except RecursionError as exc:
        raise InputError(where, "controller", f"cannot parse: {exc}") from None
    return GearShiftCursor(state, doc.last_sample_id, doc.run_key, doc.raised_by, doc.last_decline)


def parse_cursor(cursor: str | None) -> tuple[ControllerState | None, int | None, str | None]:
    """``(controller state, last metric-sample row id, run followed)`` from a cursor ((None, None, None) when empty).

    Raises:
        InputError: the cursor is not one :func:`make_cursor` wrote (named "gear_shift_sensor cursor").
    """
    state, last_id, run_key, *_ = read_gear_shift_cursor(cursor)
    return state, last_id, run_key


def make_cursor(state: ControllerState | None, last_sample_id: int | None, run_key: str | None = None,
                raised_by: str | None = None, last_decline: tuple[str, float] | None = None) -> str:
    """The cursor :func:`parse_cursor` reads back: sorted-key JSON of the state, the row id and the run key.

    ``raised_by`` (written only when set) is the trigger that raised the dwell threshold in a backlog page
    read without deciding (:meth:`~flexpipe_dag.control.controller.Controller.observe`), for the decision
    when the backlog is read. ``last_decline`` (written only when set) is the signature and time of the
    last declined decision stored for the run, so an alike one is not stored again within
    ``decline_repeat_s``.
    """
    doc: dict[str, object] = {"controller": state.to_cursor() if state else None, "last_sample_id": last_sample_id,
                              "run_key": run_key}
    if raised_by is not None:
        doc["raised_by"] = raised_by
    if last_decline is not None:
        doc["last_decline"] = list(last_decline)
    return json.dumps(doc, sort_keys=True)


def read_fleet_shift_cursor(cursor: str | None) -> dict[str, str]:
    """The ``gear_shift_sensor``'s cursor: run key -> that run's own cursor (:func:`make_cursor`), one per serving
    run it follows. A cursor written when the sensor followed one run (:func:`make_cursor`'s form) reads as that
    run's entry; an empty one as no entry.

    Raises:
        InputError: not JSON, not an object of run keys to cursors, or a run's cursor not one :func:`make_cursor`
            wrote (named; "gear_shift_sensor cursor").
    """
    if not cursor:
        return {}
    where = "gear_shift_sensor cursor"
    try:
        doc = json.loads(cursor)
    except (ValueError, RecursionError) as exc:
        raise InputError(where, None, f"cannot parse: {exc}") from None
    if not isinstance(doc, dict):
        raise InputError(where, None, f"expected a JSON object, got {type(doc).__name__}")
    if "runs" not in doc:  # one followed run (before the sensor followed several)
        run_key = read_gear_shift_cursor(cursor).run_key
        return {run_key: cursor} if run_key is not None else {}
    runs = doc["runs"]
    if set(doc) != {"runs"} or not isinstance(runs, dict):
        raise InputError(where, "runs", "expected {\"runs\": {run key: cursor}} and nothing else")
    for run_key, sub in runs.items():
        if not isinstance(sub, str):
            raise InputError(where, f"runs.{run_key}", f"expected a cursor string, got {type(sub).__name__}")
        if read_gear_shift_cursor(sub).run_key != run_key:
            raise InputError(where, f"runs.{run_key}", "the cursor follows another run")
    return dict(runs)


def make_fleet_shift_cursor(runs: dict[str, str]) -> str:
    """The cursor :func:`read_fleet_shift_cursor` reads back: sorted-key JSON of run key -> that run's cursor."""
    return json.dumps({"runs": runs}, sort_keys=True)


class RunTide(BaseModel):
    """One serving run's part of the online tide, as the ``tide_sensor`` keeps it: the run's own smoothed online
    rate (req/s), the gear its newest sample named and the pipeline instances that sample was merged from (its
    ``rps`` is theirs together)."""

    model_config = ConfigDict(extra="forbid")

    ema_rps: float = Field(ge=0.0, allow_inf_nan=False)
    gear_id: StrictStr | None = None
    instances: StrictInt = Field(1, ge=1)


class TideCursor(BaseModel):
    """The ``tide_sensor``'s cursor: each live serving run's smoothed online rate with its gear (``runs``, run key
    -> :class:`RunTide`), the fleet's rate (their sum, ``ema_rps``), the last metric-sample row read and the
    admission gate. Its size does not grow with the jobs admitted: it holds no per-job entry (at most 640 bytes with
    one live run whose run key and gear id are 200 characters each, and under 500 more per further live run; a
    run that ends or falls silent leaves it).

    Cursors written before request rates were named ``rps`` hold ``qps_ema``; it reads as ``ema_rps``.
    Cursors written before the admission count moved to the store (``inference_jobs.admissions``) hold
    ``admissions`` (job key -> times admitted): it is read so the next evaluation carries it into the
    store (run keys never repeat), and is not written again once empty. Cursors written before each run was
    smoothed on its own hold ``gear_id`` and ``instances`` (of the newest sample): they are read and dropped; the
    runs' rates start afresh from the next samples.
    """

    model_config = ConfigDict(extra="forbid")

    ema_rps: float | None = Field(None, ge=0.0, allow_inf_nan=False,
                                  validation_alias=AliasChoices("ema_rps", "qps_ema"))
    last_sample_id: RowId | None = None
    admissions: dict[str, Annotated[StrictInt, Field(ge=0)]] = Field(default_factory=dict)
    gate: TideGate = Field(default_factory=TideGate)
    runs: dict[str, RunTide] = Field(default_factory=dict)
    #: legacy (one stream for every run): read, never written
    gear_id: str | None = Field(None, exclude=True)
    instances: StrictInt = Field(1, ge=1, exclude=True)

    @classmethod
    def parse(cls, cursor: str | None) -> TideCursor:
        """Read a cursor :meth:`dump` wrote (``None`` / ``""`` = a fresh one).

        Raises:
            InputError: not JSON, or a field of the wrong type or range (named; "tide_sensor cursor").
        """
        if not cursor:
            return cls()
        try:
            doc = json.loads(cursor)
        except (ValueError, RecursionError) as exc:
            raise InputError("tide_sensor cursor", None, f"cannot parse: {exc}") from None
        if not isinstance(doc, dict):
            raise InputError("tide_sensor cursor", None, f"expected a JSON object, got {type(doc).__name__}")
        if "qps_ema" in doc and "ema_rps" in doc:
            raise InputError("tide_sensor cursor", "ema_rps", "holds both qps_ema (the old name) and ema_rps")
        try:
            return cls.model_validate(doc)
        except ValidationError as err:
            field, msg = _first_error(err)
            raise InputError("tide_sensor cursor", field, msg) from None

    def dump(self) -> str:
        """The cursor as a compact JSON string (sorted keys; ``admissions`` only while a legacy one is held)."""
        return json.dumps(self.model_dump(mode="json", exclude={"admissions"} if not self.admissions else None),
                          sort_keys=True)
