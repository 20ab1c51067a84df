"""The ``tide_sensor``: admit queued offline batch jobs in troughs of the online tide, pause them as it rises.

The decision itself is pure (:func:`flexpipe_dag.control.tide.decide_offline`); this module reads the
store, keeps the smoothed online request rate in the sensor cursor, launches ``batch_inference`` runs (low
``dagster/priority``, so online-critical runs jump them) and marks running jobs ``paused``.
"""

import json
import time
from dataclasses import dataclass, field

from dagster import DefaultSensorStatus, RunRequest, SensorEvaluationContext, SkipReason, sensor

from flexpipe_dag.control.tide import TideDecision, TideForecaster, TideGate, decide_offline, ema, load_history
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.jobs.batch import batch_inference
from flexpipe_dag.jobs.gear_shift import SENSOR_INTERVAL_S
from flexpipe_dag.resources.control import ControlSettings
from flexpipe_dag.resources.store_resource import StoreResource


@dataclass
class TideEvaluation:
    decision: TideDecision | None
    cursor: str
    admit: list = field(default_factory=list)  # InferenceJob rows to launch
    paused: list = field(default_factory=list)  # job keys marked paused


def tide_time_s(epoch_s: float, compression: float) -> float:
    """Tide time (seconds since a tide midnight) for a wall-clock instant; ``compression`` tide s per wall s."""
    return (epoch_s * compression) % 86400.0


def evaluate_tide(db, cursor: str | None, control: ControlSettings, *, epoch_s: float | None = None,
                  forecaster: TideForecaster | None = None) -> TideEvaluation:
    """One evaluation of offline admission (see module docstring)."""
    try:
        doc = json.loads(cursor) if cursor else {}
    except ValueError as exc:
        raise InputError("tide_sensor cursor", None, f"cannot parse: {exc}") from None
    cfg = control.tide_config()
    ema_rps, last_id = doc.get("ema_rps"), doc.get("last_sample_id")
    gate = TideGate.model_validate(doc.get("gate") or {})
    admissions = dict(doc.get("admissions", {}))
    rows = db.read_samples(after_id=last_id)
    for _, smp in rows:
        ema_rps = ema(ema_rps, smp.rps, cfg.ema_alpha)
    if rows:
        last_id = rows[-1][0]
    if ema_rps is None:
        return TideEvaluation(None, json.dumps(doc))
    if forecaster is None:
        forecaster = TideForecaster(load_history(cfg))
    gear_id = rows[-1][1].gear_id if rows else doc.get("gear_id")
    gear = db.load_gear(gear_id) if gear_id else None
    capacity = gear.rps_max if gear else float("inf")
    batch_jobs = db.jobs(kind="batch")
    running = [j for j in batch_jobs if j.status == "running"]
    gate = gate.model_copy(update={"running": bool(running) or gate.running and any(
        j.status == "admitted" for j in batch_jobs)})
    decision = decide_offline(forecaster, cfg, tide_time_s=tide_time_s(epoch_s or time.time(), cfg.time_compression),
                              ema_rps=ema_rps, capacity_rps=capacity, offline_running=gate.running)
    gate, act = gate.step(decision, cfg.hysteresis_samples)
    out = TideEvaluation(decision if act is None else act, "")
    if act is None:
        pass
    elif act.action == "pause":
        for j in running:
            db.update_job(j.id, status="paused")
            out.paused.append(j.job_key)
    elif act.action == "admit":
        out.admit = [j for j in batch_jobs if j.status in ("queued", "paused") and j.config]
        for j in out.admit:
            admissions[j.job_key] = admissions.get(j.job_key, 0) + 1
            db.update_job(j.id, status="admitted")
    out.cursor = json.dumps({"ema_rps": ema_rps, "last_sample_id": last_id, "admissions": admissions,
                             "gate": gate.model_dump(), "gear_id": gear_id}, sort_keys=True)
    out.run_keys = {j.job_key: f"batch:{j.job_key}:admission-{admissions[j.job_key]}" for j in out.admit}
    return out


@sensor(job=batch_inference, minimum_interval_seconds=SENSOR_INTERVAL_S, default_status=DefaultSensorStatus.RUNNING,
        description="Admits queued offline batch jobs in troughs of the online tide and pauses them when it rises.")
def tide_sensor(context: SensorEvaluationContext, store: StoreResource, control: ControlSettings):
    ev = evaluate_tide(store.get_store(), context.cursor, control)
    context.update_cursor(ev.cursor)
    if ev.decision is None:
        return SkipReason("no online metric samples yet")
    context.log.info(ev.decision.reason)
    if not ev.admit:
        return SkipReason(ev.decision.reason + (f"; paused {', '.join(ev.paused)}" if ev.paused else ""))
    return [RunRequest(run_key=ev.run_keys[j.job_key], run_config={"ops": {"run_batch": {"config": j.config}}},
                       tags={"flexpipe/job_key": j.job_key, "flexpipe/tide": ev.decision.reason[:200]})
            for j in ev.admit]
