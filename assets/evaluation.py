"""The ``gear_evaluations`` asset: every candidate gear replayed on a real reference trace in the simulator."""

import pandas as pd
from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

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


@asset(group_name="planning", kinds={"sql"}, deps=["candidate_gears"],
       description="Each candidate gear replayed on a real reference trace in the simulator: its measured "
                   "envelope (rps_max within the SLO), TTFT P99 there and estimate replace the planner's.")
def gear_evaluations(context: AssetExecutionContext, planning: PlanningSettings, store: StoreResource) -> MaterializeResult:
    from flexpipe_dag.core.settings import flexpipe_home
    from flexpipe_dag.planner.cost_model import CostModel
    from flexpipe_dag.planner.envelope import refine_envelopes
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.sim.config import SimConfig
    from flexpipe_dag.sim.evaluate import evaluate_gear, plot_evaluation
    from flexpipe_dag.workload.transform import head, speedup

    db = store.get_store()
    info, profile = latest_profile_or_fail(db)
    spec = load_model_spec(planning.model)
    cluster, overrides, _ = calibrated_inputs(db, info.id, profile, planning, spec.name)
    gears = db.load_gears(info.id)
    if not gears:
        raise InfeasibleError(f"no gears stored for profile version {info.id}: materialise candidate_gears first")
    model_id = db.save_model(spec.name, planning.dtype, spec.num_layers, spec.summary(planning.dtype))
    cost_model = CostModel(spec, cluster, dtype=planning.dtype, device_overrides=overrides)
    reference = planning.reference_workload()
    envelopes: list = []
    refined = refine_envelopes(gears, cost_model, reference, slo_ttft_ms=planning.slo_ttft_ms,
                               slo_tpot_ms=planning.slo_tpot_ms, num_requests=planning.reference_requests,
                               report=envelopes)
    db.save_gears(refined, info.id, model_id)
    config = SimConfig(slo_ttft_ms=planning.slo_ttft_ms, slo_tpot_ms=planning.slo_tpot_ms)
    base = head(reference, planning.reference_requests)
    evaluations = []
    for g in refined:  # each gear at 80 % of its measured envelope: the latency users see there
        rate = max(0.8 * g.rps_max, 1e-3)
        evaluations.append(evaluate_gear(g, cost_model.timings(g), speedup(base, rate / base.mean_rate_rps), config))
        context.log.info(f"{g.gear_id}: envelope {g.rps_min:.3g}..{g.rps_max:.3g} req/s, TTFT p99 "
                         f"{g.target_p99_ms:.4g} ms at rps_max (was {next(o for o in gears if o.gear_id == g.gear_id).rps_max:.3g})")
    png_path = plot_evaluation(evaluations, flexpipe_home() / "plots" / "gear_evaluations.png")
    return MaterializeResult(metadata={
        "profile_version_id": info.id, "workload": reference.name, "requests": planning.reference_requests,
        "envelopes": table_metadata(pd.DataFrame([{k: v for k, v in e.to_dict().items() if k != "probes" and k != "estimate"}
                                                  for e in envelopes])),
        "evaluations": table_metadata(evaluation_table(evaluations)),
        **png_metadata(png_path.read_bytes(), "gear_evaluations"),
        "ttft_cdf_ms": MetadataValue.json({ev.gear_id: ev.ttft_cdf_ms[::10] for ev in evaluations}),
    })
