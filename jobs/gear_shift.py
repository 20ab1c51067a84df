"""Gear shifting in Dagster: the ``gear_shift`` job and the ``gear_shift_sensor`` (thin wiring).

The live pipeline and Dagster meet in the SQL store. The pipeline writes metric samples; the sensor
(or the serve loop, calling the same service itself) runs
:func:`flexpipe_dag.control.service.evaluate_gear_shift`, which asks the pure controller and records
every decision taken or declined with its reason as a shift event; the sensor launches a
``gear_shift`` run for a shift. That run marks the event ``requested``; the process serving the
pipeline applies it (warm-up, drain, switch, rollback) and marks it ``done``, ``rolled_back`` or
``failed``; the run waits for that.
"""

import time

from dagster import (
    Config,
    DefaultSensorStatus,
    Failure,
    OpExecutionContext,
    RunRequest,
    SensorEvaluationContext,
    SkipReason,
    job,
    op,
    sensor,
)
from pydantic import Field

from flexpipe_dag.control.service import evaluate_gear_shift
from flexpipe_dag.core.status import TERMINAL_SHIFT_STATUSES
from flexpipe_dag.jobs.sensor_settings import SENSOR_INTERVAL_S
from flexpipe_dag.resources.control import ControlSettings
from flexpipe_dag.resources.store_resource import StoreResource


class GearShiftConfig(Config):
    """Run config of one shift (the sensor fills it; a user can launch one by hand from the UI)."""

    to_gear_id: str = Field(description="the stored gear to shift the live pipeline to")
    from_gear_id: str = Field(default="", description="the gear it runs now, for the record; empty = unknown")
    reason: str = Field(default="requested by hand", description="why, kept with the shift event")
    trigger: str = Field(default="manual", description="what decided the shift (the controller's trigger, or manual)")
    event_id: int = Field(default=0, description="the shift event the sensor recorded; 0 = record a new one "
                          "(a shift launched by hand)")
    timeout_s: float = Field(default=600.0, description="seconds to wait for the serving process to apply the "
                             "shift before the run fails")


@op(description="Ask the live pipeline to shift gears and wait until it has (done, rolled back or failed).",
    tags={"kind": "control"})
def apply_gear_shift(context: OpExecutionContext, config: GearShiftConfig, store: StoreResource) -> dict:
    db = store.get_store()
    event_id = config.event_id or db.record_shift_event(
        "shift", "decided", config.reason, from_gear_key=config.from_gear_id or None,
        to_gear_key=config.to_gear_id, trigger=config.trigger)
    db.update_shift_event(event_id, "requested", {"dagster_run_id": context.run_id})
    context.log.info(f"shift event {event_id}: requested {config.from_gear_id or '?'} -> {config.to_gear_id} "
                     f"({config.reason})")
    deadline = time.monotonic() + config.timeout_s
    while time.monotonic() < deadline:
        ev = db.get_shift_event(event_id)
        if ev.status in TERMINAL_SHIFT_STATUSES:
            break
        time.sleep(1.0)
    else:
        db.update_shift_event(event_id, "failed", {"error": f"no live pipeline applied it within {config.timeout_s:.0f} s"})
        raise Failure(f"shift event {event_id}: no live pipeline applied the shift within {config.timeout_s:.0f} s "
                      "(is a serve run or `flexpipe serve` running against this store?)")
    context.log.info(f"shift event {event_id}: {ev.status}: {ev.details.get('outcome', '')}")
    if ev.status != "done":
        raise Failure(f"shift event {event_id} {ev.status}: {ev.details.get('outcome') or ev.details.get('error')}",
                      metadata={"event_id": event_id})
    return {"event_id": event_id, "status": ev.status}


@job(description="Shift the live pipeline to another gear (launched by gear_shift_sensor, or by hand).",
     tags={"dagster/priority": "10"})
def gear_shift():
    apply_gear_shift()


@sensor(job=gear_shift, minimum_interval_seconds=SENSOR_INTERVAL_S, default_status=DefaultSensorStatus.RUNNING,
        description="Reads the newest metric samples, asks the controller, launches gear_shift when it decides to shift.")
def gear_shift_sensor(context: SensorEvaluationContext, store: StoreResource, control: ControlSettings):
    """A ``gear_shift`` run request for a shift (deterministic run key, so a retried tick launches one run), else a
    skip with the controller's reason."""
    ev = evaluate_gear_shift(store.get_store(), context.cursor, control.resolved())
    context.update_cursor(ev.cursor)
    if ev.run_key is None:
        return SkipReason(ev.summary)
    d = ev.decision
    assert d is not None and d.to_gear_id is not None  # a run key comes only with a shift, which names its target
    return RunRequest(run_key=ev.run_key, tags={"flexpipe/trigger": d.trigger or "", "flexpipe/to_gear": d.to_gear_id},
                      run_config={"ops": {"apply_gear_shift": {"config": {
                          "to_gear_id": d.to_gear_id, "from_gear_id": d.from_gear_id or "", "reason": d.reason,
                          "trigger": d.trigger or "", "event_id": ev.event_id}}}})
