"""The ``gear_evaluations`` asset: each stored gear's envelope promise checked on held-out requests of its trace."""

import math

import pandas as pd
from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    MaterializeResult,
    MetadataValue,
    asset,
    asset_check,
)

from flexpipe_dag.assets.calibration import calibrated_inputs
from flexpipe_dag.assets.metadata import latest_profile_or_fail, png_metadata, table_metadata
from flexpipe_dag.core.errors import InfeasibleError
from flexpipe_dag.resources.planning import PlanningSettings
from flexpipe_dag.resources.store_resource import StoreResource


def evaluation_table(evaluations) -> pd.DataFrame:
    rows = []
    for ev in evaluations:
        s = ev.result.summary
        rows.append({"gear": ev.gear_id, "throughput_rps": s["throughput_rps"], "tokens_per_s": s["tokens_per_s"],
                     "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
                     "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p99_ms": s["tpot_ms"]["p99"],
                     "goodput_rps": s["goodput_rps"], "slo_attainment": s["slo_attainment"]})
    return pd.DataFrame(rows)


#: The promise an envelope makes: at this share of its own rps_max a gear keeps at least this SLO attainment.
PROMISE_LOAD_SHARE = 0.8
PROMISE_MIN_ATTAINMENT = 0.9


@asset(group_name="planning", kinds={"sql"}, deps=["candidate_gears"],
       description="Each stored gear replayed at 80 % of its measured envelope on requests of the reference trace "
                   "the planner did not measure on (the runs between its own): the SLO attainment its promise gives "
                   "there, latency CDFs, stage utilisation.")
def gear_evaluations(context: AssetExecutionContext, planning: PlanningSettings, store: StoreResource) -> MaterializeResult:
    from flexpipe_dag.core.settings import flexpipe_home
    from flexpipe_dag.planner.cost_model import CostModel
    from flexpipe_dag.planner.envelope import check_promise, holdout_reference
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.sim.evaluate import evaluation_from_result, plot_evaluation

    db = store.get_store()
    info, profile = latest_profile_or_fail(db)
    spec = load_model_spec(planning.model)
    cluster, overrides, _ = calibrated_inputs(db, info.id, profile, planning, spec.name)
    gears = [g for g in db.load_gears(info.id) if math.isfinite(g.rps_max) and g.rps_max > 0]
    if not gears:
        raise InfeasibleError(f"no gears with a measured envelope stored for profile version {info.id}: "
                              "materialise candidate_gears first")
    cost_model = CostModel(spec, cluster, dtype=planning.dtype, device_overrides=overrides)
    holdout = holdout_reference(planning.reference_workload(), planning.reference_requests)
    checks = []
    for g in gears:
        chk = check_promise(g, cost_model.timings(g), holdout, slo_ttft_ms=planning.slo_ttft_ms,
                            slo_tpot_ms=planning.slo_tpot_ms, load_share=PROMISE_LOAD_SHARE,
                            min_attainment=PROMISE_MIN_ATTAINMENT)
        checks.append(chk)
        context.log.info(f"{g.gear_id}: at {chk.rate_rps:.3g} req/s ({PROMISE_LOAD_SHARE:.0%} of its envelope) on "
                         f"{chk.workload}: SLO attainment {chk.slo_attainment:.1%}, {chk.lost} lost "
                         f"({'holds' if chk.passed else 'DOES NOT HOLD'})")
    evaluations = [evaluation_from_result(c.gear_id, c.workload, c.result) for c in checks]
    png_path = plot_evaluation(evaluations, flexpipe_home() / "plots" / "gear_evaluations.png")
    return MaterializeResult(metadata={
        "profile_version_id": info.id, "workload": holdout.name, "requests": len(holdout),
        "promises": table_metadata(pd.DataFrame([{"gear": c.gear_id, "rate_rps": c.rate_rps,
                                                  "slo_attainment": c.slo_attainment, "lost": c.lost,
                                                  "holds": c.passed} for c in checks])),
        "promises_kept": sum(c.passed for c in checks), "gears": len(checks),
        "evaluations": table_metadata(evaluation_table(evaluations)),
        **png_metadata(png_path.read_bytes(), "gear_evaluations"),
        "ttft_cdf_ms": MetadataValue.json({ev.gear_id: ev.ttft_cdf_ms[::10] for ev in evaluations}),
    })


@asset_check(asset=gear_evaluations, description=f"Every gear keeps SLO attainment >= {PROMISE_MIN_ATTAINMENT:.0%} at "
                                                 f"{PROMISE_LOAD_SHARE:.0%} of its own envelope on held-out requests.")
def gear_promises_hold(context: AssetCheckExecutionContext) -> AssetCheckResult:
    event = context.instance.get_latest_materialization_event(gear_evaluations.key)
    meta = event.asset_materialization.metadata if event and event.asset_materialization else {}
    kept, total = meta.get("promises_kept"), meta.get("gears")
    if kept is None or total is None:
        return AssetCheckResult(passed=False, severity=AssetCheckSeverity.WARN,
                                description="gear_evaluations has not recorded promise checks yet")
    return AssetCheckResult(passed=kept.value == total.value, severity=AssetCheckSeverity.WARN,
                            metadata={"promises_kept": kept.value, "gears": total.value})
