"""Gear shifting in Dagster: the ``gear_shift`` job and the ``gear_shift_sensor`` (thin wiring).

The live pipeline and Dagster meet in the SQL store. The pipeline writes metric samples; the sensor
(or the serve loop, calling the same service itself) runs
:func:`flexpipe_dag.control.service.evaluate_gear_shift` on each live serving run
(:func:`~flexpipe_dag.control.service.evaluate_gear_shifts`), which asks the pure controller and records
every decision taken or declined with its reason as a shift event; the sensor launches a
``gear_shift`` run for a shift. That run marks the event ``requested``, addressed to the serving run
the decision was taken on and with a pickup deadline; that serving run takes it (``applying``),
applies it (warm-up, drain, switch, rollback) and marks it ``done``, ``rolled_back`` or ``failed``;
the run waits for that. A request no serving run took in time ``expired``. A re-executed or retried
run of an event already finished changes nothing and says so.
"""

import math
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

from flexpipe_dag.control.service import ShiftEvaluation, evaluate_gear_shifts
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.status import TERMINAL_SHIFT_STATUSES, ShiftEventAction, ShiftEventStatus
from flexpipe_dag.jobs.sensor_settings import SENSOR_INTERVAL_S
from flexpipe_dag.resources.control import ControlSettings
from flexpipe_dag.resources.store_resource import StoreResource

#: The longest wait a gear_shift run accepts (seconds): a day; longer is a typo, not a setting.
MAX_WAIT_S = 86400.0


class GearShiftConfig(Config):
    """Run config of one shift (the sensor fills it; a user can launch one by hand from the UI).

    Checked before anything is stored: texts within the store's limits, waits finite, > 0 and at most a day.
    """

    to_gear_id: str = Field(min_length=1, max_length=200, description="the stored gear to shift the live pipeline to")
    from_gear_id: str = Field(default="", max_length=200, description="the gear it runs now, for the record; empty = "
                                                                      "the gear the serving run last reported")
    reason: str = Field(default="requested by hand", description="why, kept with the shift event")
    trigger: str = Field(default="manual", max_length=40,
                         description="what decided the shift (the controller's trigger, or manual)")
    event_id: int = Field(default=0, ge=0, description="the shift event the sensor recorded; 0 = record a new one "
                          "(a shift launched by hand)")
    timeout_s: float = Field(default=600.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False,
                             description="seconds (at most a day) to wait for the serving run to apply the shift "
                                         "before the run fails")
    pickup_deadline_s: float = Field(
        default=120.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False,
        description="the serving run must take the request within this many seconds (at most a day), else it "
                    "expires (a later serving run never applies it)")
    run_key: str = Field(default="", max_length=200,
                         description="the serving run to shift; \"\" = the live serving run that writes metric samples "
                                     "and does not decide its own shifts (a shift by hand; with several such runs live, "
                                     "name one)")


def _check_target(db, run_key: str) -> None:
    """Refuse a serving run a shift cannot be addressed to: one never seen, ended, or a batch job.

    Raises:
        Failure: ``run_key`` is not a live serving run (why named).
    """
    live = db.pipeline_liveness(run_key)
    why = live.why_not_live(time.time(), math.inf)  # staleness is the pickup deadline's business
    if why is not None:
        raise Failure(f"gear_shift config run_key {run_key!r}: not a live serving run ({why})")


def _event_for(context: OpExecutionContext, config: GearShiftConfig, db) -> int:
    """The shift event this run applies: the sensor's (``event_id``), else one recorded for a shift by hand, keyed
    by the run's root run id so a re-execution finds the same event.

    Raises:
        Failure: ``event_id`` is not a stored event; a shift by hand to a gear that is not stored, to a
            ``run_key`` that is not a live serving run, or with no live serving run to address it to.
    """
    if config.event_id:
        try:
            db.get_shift_event(config.event_id)
        except KeyError:
            raise Failure(f"gear_shift config event_id {config.event_id}: no such shift event is stored (0 = record "
                          "a new one, a shift by hand)") from None
        return config.event_id
    if db.load_gear(config.to_gear_id) is None:
        raise Failure(f"gear_shift config to_gear_id {config.to_gear_id!r}: not a stored gear (name one of the "
                      "gear ids `flexpipe plan` stored)")
    if config.run_key:
        _check_target(db, config.run_key)
    else:
        live = db.recent_shiftable_run_keys()
        if len(live) > 1:  # a shift by hand is addressed to one pipeline: never a guess among several
            raise Failure(f"several serving runs are live ({', '.join(live)}): name the one to shift with run_key")
    target = config.run_key or db.latest_shiftable_run_key()
    if target is None:
        raise Failure("no live serving run to shift: no run that has not ended writes metric samples (start a "
                      "serve_trace run, or name one with run_key)")
    root_run_id = context.run.root_run_id or context.run_id
    from_gear = config.from_gear_id or db.pipeline_liveness(target).gear_key
    return db.record_shift_event("shift", ShiftEventStatus.DECIDED, config.reason,
                                 from_gear_key=from_gear, to_gear_key=config.to_gear_id,
                                 trigger=config.trigger, run_key=target, decision_key=f"manual:{root_run_id}")


@op(description="Ask the live pipeline to shift gears and wait until it has (done, rolled back, failed or expired).",
    tags={"kind": "control"})
def apply_gear_shift(context: OpExecutionContext, config: GearShiftConfig, store: StoreResource) -> dict:
    """Request the shift from the serving run it is addressed to, then wait for the outcome.

    Idempotent: an event that is already terminal (a re-executed run, a retried one) is left as it is,
    its stored ``dagster_run_id`` included, and the run succeeds saying so; one that another run already
    requested is waited for, not requested again.
    """
    db = store.get_store()
    event_id = _event_for(context, config, db)
    ev = db.get_shift_event(event_id)
    if ev.action != ShiftEventAction.SHIFT:
        raise Failure(f"shift event {event_id} is a {ev.status} {ev.action}, not a shift to apply")
    if ev.status in TERMINAL_SHIFT_STATUSES:
        note = (f"shift event {event_id} is already {ev.status} (requested by run "
                f"{ev.details.get('dagster_run_id') or '?'}): nothing to do, the event is left as it is")
        context.log.info(note)
        context.add_output_metadata({"event_id": event_id, "status": ev.status, "noop": True, "note": note})
        return {"event_id": event_id, "status": ev.status, "noop": True, "note": note}
    if ev.status == ShiftEventStatus.DECIDED:
        target = ev.run_key or config.run_key or db.latest_shiftable_run_key()
        if target is None:
            db.update_shift_event(event_id, ShiftEventStatus.FAILED, {"error": "no live serving run to address it to"})
            raise Failure(f"shift event {event_id}: no live serving run to shift")
        _, ev = db.request_shift(event_id, target, config.pickup_deadline_s, {"dagster_run_id": context.run_id})
        from_gear = ev.from_gear_key or db.pipeline_liveness(target).gear_key or "the serving gear"
        context.log.info(f"shift event {event_id}: requested {from_gear} -> {ev.to_gear_key} of serving "
                         f"run {ev.run_key}, to be taken within {config.pickup_deadline_s:.0f} s ({ev.reason})")
    else:
        context.log.info(f"shift event {event_id} is already {ev.status} (run {ev.details.get('dagster_run_id') or '?'}"
                         "): waiting for its outcome without asking again")
    deadline = time.monotonic() + config.timeout_s
    while True:
        db.expire_shift_requests(event_id)
        ev = db.get_shift_event(event_id)
        if ev.status in TERMINAL_SHIFT_STATUSES:
            break
        if time.monotonic() >= deadline:
            raise Failure(f"shift event {event_id}: still {ev.status} after {config.timeout_s:.0f} s (is a serve_trace "
                          f"run serving against this store as run {ev.run_key}? only its serve loop applies shifts)")
        time.sleep(1.0)
    outcome = ev.details.get("outcome") or ev.details.get("error") or ""
    context.log.info(f"shift event {event_id}: {ev.status}: {outcome}")
    if ev.status != ShiftEventStatus.DONE:
        raise Failure(f"shift event {event_id} {ev.status}: {outcome}", metadata={"event_id": event_id})
    return {"event_id": event_id, "status": ev.status}


@job(description="Shift the live pipeline to another gear (launched by gear_shift_sensor, or by hand).",
     tags={"dagster/priority": "10"})
def gear_shift():
    apply_gear_shift()


@sensor(job=gear_shift, minimum_interval_seconds=SENSOR_INTERVAL_S, default_status=DefaultSensorStatus.RUNNING,
        description="Reads the newest metric samples of each live serving run, asks the controller, launches gear_shift "
                    "when it decides to shift one.")
def gear_shift_sensor(context: SensorEvaluationContext, store: StoreResource, control: ControlSettings):
    """A ``gear_shift`` run request per serving run whose controller decided a shift (deterministic run keys, so a
    retried tick launches each once), else a skip with each run's decision or why there is none."""
    db = store.get_store()
    for event_id in db.expire_shift_requests():  # requests of runs that died waiting
        context.log.info(f"shift event {event_id} expired: no live serving run took it by its deadline")
    fleet = evaluate_gear_shifts(db, context.cursor, control.resolved())
    context.update_cursor(fleet.cursor)
    for line in fleet.errors:
        context.log.error(f"not evaluated: {line}")
    if fleet.errors and len(fleet.errors) == len(fleet.evaluations):
        raise InputError("metric samples", None, f"no serving run could be evaluated: {'; '.join(fleet.errors)}")
    if not fleet.shifts:
        return SkipReason(fleet.summary)
    for run_key, ev in fleet.evaluations.items():
        if ev.run_key is None and len(fleet.evaluations) > 1:
            context.log.info(f"run {run_key}: {ev.summary}")
    requests = [_shift_request(ev) for ev in fleet.shifts]
    return requests[0] if len(requests) == 1 else requests


def _shift_request(ev: ShiftEvaluation) -> RunRequest:
    """The ``gear_shift`` run of a decided shift (its deterministic run key; the event names the serving run)."""
    d = ev.decision
    assert d is not None and d.to_gear_id is not None and ev.run_key is not None  # a shift names its target
    return RunRequest(run_key=ev.run_key, tags={"flexpipe/trigger": d.trigger or "", "flexpipe/to_gear": d.to_gear_id},
                      run_config={"ops": {"apply_gear_shift": {"config": {
                          "to_gear_id": d.to_gear_id, "from_gear_id": d.from_gear_id or "", "reason": d.reason,
                          "trigger": d.trigger or "", "event_id": ev.event_id}}}})
