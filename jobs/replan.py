"""``replan_sensor``: a calibration that moves gear estimates past the margin re-plans the gears.

The ``calibration`` asset re-scores the stored gears with the calibrated cost model and records
``needs_replan`` (an estimate moved by more than ``PlanningSettings.replan_margin``, or the planner's
picks changed). This sensor reads that materialisation and launches ``plan_gears`` once per
calibration (run key ``replan:calibration-<id>``), so ``candidate_gears`` and ``gear_evaluations``
use the new figures and the controller's envelopes follow.
"""

from dagster import (
    AssetKey,
    DefaultSensorStatus,
    EventLogEntry,
    RunRequest,
    SensorEvaluationContext,
    SkipReason,
    asset_sensor,
)

from flexpipe_dag.jobs.profiling import plan_gears_job


@asset_sensor(asset_key=AssetKey("calibration"), job=plan_gears_job, default_status=DefaultSensorStatus.RUNNING,
              description="Re-plans the gears when a new calibration changes their estimates past the margin.")
def replan_sensor(context: SensorEvaluationContext, asset_event: EventLogEntry):
    materialization = asset_event.asset_materialization
    if materialization is None:  # an asset sensor is handed materialisations; anything else has nothing to read
        return SkipReason("not a materialisation of calibration: nothing to re-plan")
    meta = materialization.metadata
    calibration_id = meta.get("calibration_id")
    if calibration_id is None:
        return SkipReason("calibration kept the profile's values: nothing to re-plan")
    if not meta["needs_replan"].value:
        return SkipReason(f"calibration {calibration_id.value} moves no gear estimate past the margin")
    return RunRequest(run_key=f"replan:calibration-{calibration_id.value}",
                      tags={"flexpipe/calibration_id": str(calibration_id.value)})
