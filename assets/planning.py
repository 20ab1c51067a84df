"""Planning assets: ``model_profile``, ``candidate_gears`` (+ fit check) and ``gear_evaluations``."""

import pandas as pd
from dagster import (
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
from flexpipe_dag.plots import gear_layout_plot
from flexpipe_dag.resources.planning import PlanningSettings
from flexpipe_dag.resources.store_resource import StoreResource


def stage_table(gears) -> pd.DataFrame:
    """One row per (gear, stage): layers, devices, estimated time, weights, KV capacity."""
    return pd.DataFrame([{
        "gear": g.gear_id, "kind": g.kind, "stage": st.stage_index, "layers": f"{st.layer_start}-{st.layer_end - 1}",
        "devices": ", ".join(st.device_ids), "est_stage_ms": st.est_stage_ms, "weight_gib": st.weight_gib,
        "kv_capacity_tokens": st.kv_capacity_tokens, "micro_batch": g.micro_batch_size,
        "rps_max": g.rps_max, "target_p99_ms": g.target_p99_ms,
    } for g in gears for st in g.stages])


def _model(settings: PlanningSettings):
    from flexpipe_dag.planner.model_spec import load_model_spec

    return load_model_spec(settings.model)


@asset(group_name="planning", kinds={"sql"},
       description="The model's cost profile (per-layer bytes, FLOPs, KV/token) stored in the SQL store.")
def model_profile(context: AssetExecutionContext, planning: PlanningSettings, store: StoreResource) -> MaterializeResult:
    spec = _model(planning)
    summary = spec.summary(planning.dtype)
    db = store.get_store()
    known = db.model_ids(spec.name)
    model_id = db.save_model(spec.name, planning.dtype, spec.num_layers, summary)
    if known and model_id not in known:
        cleared = db.clear_health(f"model {spec.name} changed (model id {model_id})", model_name=spec.name)
        context.log.info(f"model {spec.name} changed; cleared {cleared} health tag(s)")
    return MaterializeResult(metadata={
        "model_id": model_id, "name": spec.name, "num_layers": spec.num_layers,
        "total_params": int(summary["total_params"]), "weight_gib": float(summary["weight_gib"]),
        "kv_kib_per_token": float(summary["kv_kib_per_token"]),
        "summary": MetadataValue.json(summary),
    })


@asset(group_name="planning", kinds={"sql"}, deps=["gpu_profile", model_profile, "calibration"],
       description="Latency / balanced / throughput gears for the model on the newest cluster profile (with the "
                   "newest calibration applied), chosen by envelopes measured in the simulator at the SLO.")
def candidate_gears(context: AssetExecutionContext, planning: PlanningSettings, store: StoreResource) -> MaterializeResult:
    db = store.get_store()
    info, profile = latest_profile_or_fail(db)
    spec = _model(planning)
    model_id = db.save_model(spec.name, planning.dtype, spec.num_layers, spec.summary(planning.dtype))
    cluster, overrides, cal = calibrated_inputs(db, info.id, profile, planning, spec.name)
    context.log.info("planning with the " + (f"calibrated cost model ({cal.num_observations} measured steps)"
                                             if cal else "profiled cost model"))
    plan = planning.plan(cluster, spec, profile_version=info.id, device_overrides=overrides, progress=context.log.info)
    gears = plan.gears
    db.save_gears(gears, info.id, model_id)
    context.log.info(f"planned for {plan.workload}; envelopes: {plan.basis.describe()}; {plan.probes} simulations "
                     f"in {plan.wall_s:.1f} s")
    for g in gears:
        context.log.info(f"{g.gear_id}: {g.num_stages} stage(s) {g.layer_ranges()}, micro-batch {g.micro_batch_size}, "
                         f"envelope {g.rps_min:.3g}..{g.rps_max:.3g} req/s (analytic {plan.analytic_rps_max[g.gear_id]:.3g})")
    for note in plan.notes:
        context.log.info(note)
    rec = plan.recommendation
    return MaterializeResult(metadata={
        "profile_version_id": info.id, "model_id": model_id, "cluster_id": cluster.cluster_id,
        "calibrated": cal is not None, "envelope_basis": plan.basis.describe(),
        "context": MetadataValue.json(plan.context.to_dict() if plan.context else {}),
        "gears": MetadataValue.json([g.gear_id for g in gears]),
        "stages": table_metadata(stage_table(gears)),
        "envelopes": table_metadata(envelope_table(plan)),
        "recommended": MetadataValue.json({"gear_id": rec.gear_id, "load_rps": rec.load_rps,
                                           "headroom_fraction": rec.headroom_fraction, "reason": rec.reason}
                                          if rec else {"gear_id": None, "reason": "no load_rps set"}),
        "planning_wall_s": round(plan.wall_s, 2), "simulations": plan.probes,
        **png_metadata(gear_layout_plot(gears), "gear_layout"),
    })


def envelope_table(plan) -> pd.DataFrame:
    """One row per candidate: measured ``rps_max``, probes run, whether ``rps_max`` was confirmed on long probes
    (only gears chosen in some round are) and how many probes stopped early."""
    return pd.DataFrame([{"candidate": e.gear_id, "rps_max": e.rps_max, "ttft_p99_ms_at_max": e.target_p99_ms,
                          "probes": len(e.probes), "confirmed": e.confirmed,
                          "stopped_early": sum(p.stopped_s is not None for p in e.probes)}
                         for e in plan.envelopes])


@asset_check(asset=candidate_gears, description="Every stored gear fits its devices' memory and its links' bandwidth.")
def candidate_gears_fit(planning: PlanningSettings, store: StoreResource) -> AssetCheckResult:
    from flexpipe_dag.planner.verify import gear_problems

    db = store.get_store()
    latest = db.latest_profile()
    if latest is None:
        return AssetCheckResult(passed=False, severity=AssetCheckSeverity.ERROR, description="no profile stored")
    info, cluster = latest
    spec = _model(planning)
    gears = db.load_gears(info.id)
    problems = [p for g in gears for p in gear_problems(g, cluster, spec)]
    return AssetCheckResult(passed=bool(gears) and not problems, severity=AssetCheckSeverity.ERROR,
                            metadata={"gears_checked": len(gears),
                                      "problems": MetadataValue.md("\n".join(f"- {p}" for p in problems) or "none")})
