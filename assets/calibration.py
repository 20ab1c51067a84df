"""The ``calibration`` asset: live stage-step measurements correct the cost model (a new calibration version).

Fits per-device efficiency factors from the steps runs recorded that no earlier calibration of this
profile version used, chained on the previous calibration as prior. A device without enough new
evidence keeps its values; the probe's raw numbers are never touched. ``candidate_gears`` and
``gear_evaluations`` then plan and score with the calibrated cost model.
"""

import pandas as pd
from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from flexpipe_dag.assets.metadata import latest_profile_or_fail, png_metadata, table_metadata
from flexpipe_dag.resources.planning import PlanningSettings
from flexpipe_dag.resources.store_resource import StoreResource

#: Fewest new stage steps worth a calibration.
MIN_NEW_STEPS = 10


def calibrated_inputs(db, profile_version_id: int, cluster, planning: PlanningSettings, model_name: str):
    """``(cluster, device_overrides, calibration or None)`` for planning: the newest calibration applied."""
    cal = db.latest_calibration(profile_version_id, model_name=model_name, dtype=planning.dtype)
    if cal is None:
        return cluster, None, None
    return cal.calibrated_cluster(cluster), cal.device_overrides(), cal


@asset(group_name="planning", kinds={"sql"}, deps=["gpu_profile", "model_profile"],
       description="Per-device efficiency factors fitted from measured stage steps; a new calibration version.")
def calibration(context: AssetExecutionContext, planning: PlanningSettings, store: StoreResource) -> MaterializeResult:
    from flexpipe_dag.calibration.calibrate import calibrate
    from flexpipe_dag.calibration.plots import plot_predicted_vs_measured, stage_time_errors
    from flexpipe_dag.planner.cost_model import CostModel
    from flexpipe_dag.planner.model_spec import load_model_spec

    db = store.get_store()
    info, cluster = latest_profile_or_fail(db)
    spec = load_model_spec(planning.model)
    used = {k for row in db.calibrations(info.id) for k in row.run_keys}
    runs = [r for r in db.observed_runs() if r["cluster_key"] == cluster.cluster_id and r["run_key"] not in used]
    observations = [o for r in runs for o in db.read_observations(run_key=r["run_key"], gear_key=r["gear_key"])]
    known = {d.device_id for d in cluster.devices}
    observations = [o for o in observations if o.device_id in known]
    prior = db.latest_calibration(info.id, model_name=spec.name, dtype=planning.dtype)
    if len(observations) < MIN_NEW_STEPS:
        context.log.info(f"{len(observations)} new stage steps for {cluster.cluster_id}: profile values kept")
        return MaterializeResult(metadata={"profile_version_id": info.id, "new_steps": len(observations),
                                           "calibration_version": None,
                                           "summary": MetadataValue.md("no new evidence: the profile's values are kept")})
    cal = calibrate(spec, cluster, observations, dtype=planning.dtype, prior=prior)
    cal_id, version = db.save_calibration(info.id, cal, run_keys=sorted({r["run_key"] for r in runs}))
    for line in cal.summary_lines():
        context.log.info(line)
    from flexpipe_dag.calibration.rescore import rescore_gears

    rescore = rescore_gears(spec, cluster, cal, db.load_gears(info.id), dtype=planning.dtype,
                            workload=planning.plan_workload(), margin=planning.replan_margin)
    for line in rescore.messages():
        context.log.info(line)
    before = CostModel(spec, cluster, dtype=planning.dtype, device_overrides=cal.base_overrides or None)
    after = cal.cost_model(spec, cluster)
    errors = stage_time_errors(before, after, observations)
    return MaterializeResult(metadata={
        "profile_version_id": info.id, "calibration_id": cal_id, "calibration_version": version,
        "new_steps": len(observations), "runs": MetadataValue.json(sorted({r["run_key"] for r in runs})),
        "changed_devices": MetadataValue.json(cal.changed_devices()),
        "needs_replan": rescore.needs_replan,
        "rescore": MetadataValue.md("\n".join(f"- {m}" for m in rescore.messages()) or "no gear stored yet"),
        "summary": MetadataValue.md("\n".join(f"- {line}" for line in cal.summary_lines())),
        "stage_time_error": table_metadata(pd.DataFrame([{"device": d, **v} for d, v in errors.items()])),
        **png_metadata(plot_predicted_vs_measured(before, after, observations), "calibration_predicted_vs_measured"),
    })
