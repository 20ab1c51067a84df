"""Gear shifting in Dagster: the decision function, the ``gear_shift`` job and the ``gear_shift_sensor``.

The live pipeline and Dagster meet in the SQL store. The pipeline writes metric samples; the sensor
(or the serve loop, calling :func:`evaluate_gear_shift` itself) asks the pure controller, records every
decision taken or declined with its reason as a shift event, and launches a ``gear_shift`` run for a
shift. That run marks the event ``requested``; the process serving the pipeline applies it (warm-up,
drain, switch, rollback) and marks it ``done``, ``rolled_back`` or ``failed``; the run waits for that.
"""

import json
import time
from dataclasses import dataclass

from dagster import (Config, DefaultSensorStatus, Failure, OpExecutionContext, RunRequest, SensorEvaluationContext,
                     SkipReason, job, op, sensor)

from flexpipe_dag.control.controller import Controller
from flexpipe_dag.control.state import ControllerState, Decision
from flexpipe_dag.core.errors import FlexPipeError, InputError
from flexpipe_dag.core.settings import env_value
from flexpipe_dag.core.status import TERMINAL_SHIFT_STATUSES
from flexpipe_dag.resources.control import ControlSettings
from flexpipe_dag.resources.store_resource import StoreResource

#: Sensor evaluation interval, seconds (``FLEXPIPE_SENSOR_INTERVAL_S``).
SENSOR_INTERVAL_S = env_value("FLEXPIPE_SENSOR_INTERVAL_S", int, 30, ge=1, le=86_400, unit="seconds")


@dataclass(frozen=True)
class ShiftEvaluation:
    """One evaluation: the decision (None when no new samples), the cursor to keep, the stored event and run key."""

    decision: Decision | None
    cursor: str
    event_id: int | None = None
    run_key: str | None = None

    @property
    def summary(self) -> str:
        return self.decision.reason if self.decision else "no new metric samples"


def parse_cursor(cursor: str | None) -> tuple[ControllerState | None, int | None, str | None]:
    """``(controller state, last metric-sample row id, run followed)`` from a sensor cursor.

    Raises:
        InputError: the cursor is not one this sensor wrote.
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
    return json.dumps({"controller": state.to_cursor() if state else None, "last_sample_id": last_sample_id,
                       "run_key": run_key}, sort_keys=True)


def shift_run_key(decision: Decision) -> str:
    """Deterministic run key: the same decision always maps to the same key (no duplicate runs)."""
    return f"gear-shift:{decision.from_gear_id}->{decision.to_gear_id}@t{decision.t_s:.1f}"


def _migration_cost(db, gears):
    """The controller's migration-cost function for the newest profile, or None when it cannot be built."""
    from flexpipe_dag.control.migration import migration_cost_fn
    from flexpipe_dag.planner.model_spec import load_model_spec

    latest = db.latest_profile()
    if latest is None or not gears:
        return None
    _, cluster = latest
    try:
        spec = load_model_spec(gears[0].model_name)
    except FlexPipeError:
        return None
    dtype = gears[0].dtype
    return migration_cost_fn(cluster, [spec.layer_weight_bytes(dtype)] * spec.num_layers,
                             embedding_bytes=spec.first_stage_extra_bytes(dtype),
                             lm_head_bytes=spec.last_stage_extra_bytes(dtype),
                             fallback_bandwidth_gbps=min((l.bandwidth_gbps for l in cluster.links), default=1.0))


def candidate_gears_for(db, serving_gear_ids) -> list:
    """The newest profile's current gears, plus any gear the samples name that an earlier plan made."""
    latest = db.list_profile_versions()
    gears = db.load_gears(latest[-1].id) if latest else []
    known = {g.gear_id for g in gears}
    for gear_id in dict.fromkeys(serving_gear_ids):
        if gear_id not in known and (gear := db.load_gear(gear_id)) is not None:
            gears.append(gear)
            known.add(gear_id)
    return gears


def tide_history_forecast(control: ControlSettings, newest_t_s: float, epoch_s: float | None = None):
    """The controller's load forecast from the tide history (``tide.history_file``, else the bundled
    ServeGen tide), on the metric samples' clock.

    A sample's ``t_s`` counts from its run's start, so it is placed in wall time by its distance to
    the newest sample (taken as now, ``epoch_s``), then in tide time as the ``tide_sensor`` does
    (``time_compression`` of the ``tide`` settings).
    """
    from flexpipe_dag.control.tide import TideForecaster, load_history, tide_forecast
    from flexpipe_dag.jobs.tide import tide_time_s

    cfg = control.tide_config()
    compression = cfg.time_compression
    now = time.time() if epoch_s is None else epoch_s
    return tide_forecast(TideForecaster(load_history(cfg)),
                         lambda t_s: tide_time_s(now - (newest_t_s - t_s), compression), compression)


def evaluate_gear_shift(db, cursor: str | None, control: ControlSettings, run_key_prefix: str = "",
                        run_key: str | None = None, forecast=None, epoch_s: float | None = None) -> ShiftEvaluation:
    """Read new samples, ask the controller, store the decision if a trigger fired; see module docstring.

    ``run_key``: the serving run whose samples to follow (default: the run that wrote the newest
    sample). When the followed run changes, the controller starts afresh. ``forecast``: the
    controller's load forecast; None with ``forecast_horizon_s`` > 0 in the controller settings uses
    :func:`tide_history_forecast` (``epoch_s``: now, for tests).
    """
    state, last_id, followed = parse_cursor(cursor)
    run_key = run_key or db.latest_sample_run_key()
    if run_key != followed:
        state = None
    rows = db.read_samples(run_key=run_key, after_id=last_id) if run_key else []
    if not rows:
        return ShiftEvaluation(None, make_cursor(state, last_id, run_key))
    samples = [s for _, s in rows]
    gears = candidate_gears_for(db, [smp.gear_id for smp in samples])
    config = control.controller_config()
    if forecast is None and config.forecast_horizon_s > 0:
        forecast = tide_history_forecast(control, max(smp.t_s for smp in samples), epoch_s)
    new_state, decision = Controller(config).decide(
        state, samples, gears, unhealthy=db.unhealthy_gear_keys(), migration_cost_s=_migration_cost(db, gears),
        forecast=forecast)
    cursor = make_cursor(new_state, rows[-1][0], run_key)
    if decision.action != "shift" and not decision.declined:
        return ShiftEvaluation(decision, cursor)
    event_id = db.record_shift_event(
        decision.action, "decided" if decision.action == "shift" else "declined", decision.reason,
        from_gear_key=decision.from_gear_id, to_gear_key=decision.to_gear_id, trigger=decision.trigger,
        est_gain=decision.estimated_gain_fraction, migration_cost_s=decision.migration_cost_s,
        details=decision.model_dump())
    run_key = run_key_prefix + shift_run_key(decision) if decision.action == "shift" else None
    return ShiftEvaluation(decision, cursor, event_id, run_key)


class GearShiftConfig(Config):
    """Run config of one shift (the sensor fills it; a user can launch one by hand from the UI)."""

    to_gear_id: str
    from_gear_id: str = ""
    reason: str = "requested by hand"
    trigger: str = "manual"
    event_id: int = 0
    timeout_s: float = 600.0


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
    ev = evaluate_gear_shift(store.get_store(), context.cursor, control)
    context.update_cursor(ev.cursor)
    if ev.run_key is None:
        return SkipReason(ev.summary)
    d = ev.decision
    return RunRequest(run_key=ev.run_key, tags={"flexpipe/trigger": d.trigger or "", "flexpipe/to_gear": d.to_gear_id},
                      run_config={"ops": {"apply_gear_shift": {"config": {
                          "to_gear_id": d.to_gear_id, "from_gear_id": d.from_gear_id or "", "reason": d.reason,
                          "trigger": d.trigger or "", "event_id": ev.event_id}}}})
