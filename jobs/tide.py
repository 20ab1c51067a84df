"""The ``tide_sensor``: admit queued offline batch jobs in troughs of the online tide, pause them as it rises.

Thin wiring: the evaluation (read the store, keep the smoothed online request rate in the cursor,
decide with :func:`flexpipe_dag.control.tide.decide_offline`, mark jobs ``admitted`` / ``paused``) is
:func:`flexpipe_dag.control.service.evaluate_tide`; this sensor keeps its cursor and launches
``batch_inference`` runs (low ``dagster/priority``, so online-critical runs jump them) for the admissions.
"""

from collections.abc import Sequence

from dagster import DefaultSensorStatus, RunRequest, SensorEvaluationContext, SkipReason, sensor

from flexpipe_dag.control.service import evaluate_tide
from flexpipe_dag.jobs.batch import batch_inference
from flexpipe_dag.jobs.sensor_settings import SENSOR_INTERVAL_S
from flexpipe_dag.resources.control import ControlSettings
from flexpipe_dag.resources.store_resource import StoreResource


def no_config_line(job_keys: Sequence[str]) -> str | None:
    """One line naming the jobs an admission skipped for want of a stored config (None when there are none)."""
    if not job_keys:
        return None
    named = ", ".join(job_keys[:5]) + (f" and {len(job_keys) - 5} more" if len(job_keys) > 5 else "")
    return (f"not admitted, no stored config (inference_jobs.config is empty): {named}; run each once with "
            "`dagster job execute -j batch_inference` and its config, which stores it")


@sensor(job=batch_inference, minimum_interval_seconds=SENSOR_INTERVAL_S, default_status=DefaultSensorStatus.RUNNING,
        description="Admits queued offline batch jobs in troughs of the online tide and pauses them when it rises.")
def tide_sensor(context: SensorEvaluationContext, store: StoreResource, control: ControlSettings):
    """One ``batch_inference`` run request per admitted job (run key ``batch:<job key>:admission-<n>``, n from the
    job row), else a skip with the tide's reason (and the jobs paused)."""
    settings = control.resolved()
    ev = evaluate_tide(store.get_store(), context.cursor, settings.tide,
                       freshness_s=settings.controller.sample_freshness_s)
    context.update_cursor(ev.cursor)
    if ev.decision is None:
        return SkipReason("no online metric samples yet")
    for line in ev.runs_left:
        context.log.info(f"left the online tide: {line}")
    context.log.info(ev.decision.reason)
    unconfigured = no_config_line(ev.no_config)
    if unconfigured:
        context.log.warning(unconfigured)
    if not ev.admit:
        return SkipReason(ev.decision.reason + (f"; paused {', '.join(ev.paused)}" if ev.paused else "")
                          + (f"; {unconfigured}" if unconfigured else ""))
    return [RunRequest(run_key=ev.run_keys[j.job_key], run_config={"ops": {"run_batch": {"config": j.config}}},
                       tags={"flexpipe/job_key": j.job_key, "flexpipe/tide": ev.decision.reason[:200]})
            for j in ev.admit]
