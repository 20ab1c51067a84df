"""The ``fleet_day`` asset: the fleet's pipeline instances (fleet gears) and a day of the tide on them.

Plans every instance of the cluster (one plan and one simulated envelope per host shape,
:func:`~flexpipe_dag.planner.fleet.plan_fleet`) for the configured model and SLO (the ``planning``
resource), measures each shape's attainment curve, and plays a day of the ServeGen tide on the fleet:
the fleet scaler against the best static fleet gear at equal attainment (:mod:`flexpipe_dag.control.fleet_day`).
Metadata: the instances per shape, the two policies' figures, and the devices held per hour (PNG).
"""

import numpy as np
import pandas as pd
from dagster import AssetExecutionContext, Config, MaterializeResult, MetadataValue, asset
from pydantic import Field

from flexpipe_dag.assets.metadata import cluster_for_run, png_metadata, table_metadata
from flexpipe_dag.control.fleet_scaler import DEFAULT_SCALE_IN_HEADROOM_FRACTION
from flexpipe_dag.planner.fleet import DEFAULT_HEADROOM_FRACTION
from flexpipe_dag.resources.planning import PlanningSettings
from flexpipe_dag.resources.store_resource import StoreResource


class FleetDayConfig(Config):
    """Run config of ``fleet_day`` (units in the names)."""

    cluster_file: str = Field(default="", description="cluster YAML (e.g. examples/clusters/fleet_1k.yaml); empty = the "
                                                      "newest stored cluster profile")
    start_day: int = Field(default=0, ge=0, le=13, description="day of the 14-day ServeGen tide")
    peak_share: float = Field(default=0.8, gt=0, le=1.5, description="the day's peak as a share of the fleet's summed "
                                                                     "envelope")
    headroom_fraction: float = Field(default=DEFAULT_HEADROOM_FRACTION, ge=0, lt=1,
                                     description="share of the envelope the scaler keeps free")
    scale_in_headroom_fraction: float = Field(default=DEFAULT_SCALE_IN_HEADROOM_FRACTION, ge=0, lt=1,
                                              description="the scaler gives instances back only below 1 - this")
    envelope_requests: int = Field(default=1000, ge=50, le=100000, description="trace requests per envelope probe")


def _per_hour(held_devices: np.ndarray, window_s: float) -> list[float]:
    per_hour = int(round(3600.0 / window_s))
    hours = len(held_devices) // per_hour
    return [float(x) for x in held_devices[: hours * per_hour].reshape(hours, per_hour).mean(axis=1)]


@asset(group_name="fleet", deps=["gpu_profile"],
       description="The fleet's pipeline instances (one plan per host shape) and a day of the tide on them: the fleet "
                   "scaler vs the best static fleet gear; devices held per hour.")
def fleet_day(context: AssetExecutionContext, config: FleetDayConfig, planning: PlanningSettings,
              store: StoreResource) -> MaterializeResult:
    from flexpipe_dag.control.fleet_day import compare_day
    from flexpipe_dag.control.fleet_scaler import FleetScalerConfig
    from flexpipe_dag.planner.fleet import FleetSettings, describe_plan, plan_fleet
    from flexpipe_dag.planner.fleet_curve import measure_attainment_curves
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.plots import reservation_curve_plot

    cluster = cluster_for_run(config.cluster_file, store)
    spec = load_model_spec(planning.model)
    reference = planning.capped_reference_trace()
    settings = FleetSettings(slo_ttft_ms=planning.slo_ttft_ms, slo_tpot_ms=planning.slo_tpot_ms,
                             num_requests=config.envelope_requests)
    plan = plan_fleet(cluster, spec, reference, dtype=planning.dtype, settings=settings)
    context.log.info(f"{len(plan.instances)} instances from {len(plan.templates)} host shapes, envelope "
                     f"{plan.rps_max:.2f} req/s")
    curves = measure_attainment_curves(plan, reference, settings)
    scaler = FleetScalerConfig(headroom_fraction=config.headroom_fraction,
                               scale_in_headroom_fraction=config.scale_in_headroom_fraction)
    run = compare_day(plan, curves, config.start_day, peak_rps=config.peak_share * plan.rps_max, settings=settings,
                      scaler_config=scaler)
    dyn, static = run.dynamic, run.static
    title = f"{spec.name} on {cluster.cluster_id}, tide day {config.start_day}"
    png = reservation_curve_plot({"dynamic": _per_hour(dyn.held_devices, dyn.window_s),
                                  static.policy: _per_hour(static.held_devices, static.window_s)},
                                 sum(i.num_devices for i in plan.instances), f"devices held per hour ({title})")
    ratio = run.device_hours_ratio
    context.log.info(f"fleet day {title}: dynamic {dyn.summary()}; {static.policy} {static.summary()}")
    return MaterializeResult(metadata={
        "instances": MetadataValue.int(len(plan.instances)),
        "fleet_rps_max": MetadataValue.float(plan.rps_max),
        "shapes": table_metadata(pd.DataFrame(describe_plan(plan))),
        "notes": MetadataValue.md("\n".join(f"- {n}" for n in plan.notes) or "every host serves"),
        "policies": table_metadata(pd.DataFrame([dyn.summary(), static.summary()])),
        "device_hours_vs_best_static": MetadataValue.float(ratio),
        "bound_vs_best_static": MetadataValue.float(run.bound_ratio),
        "dynamic_slo_attainment": MetadataValue.float(dyn.slo_attainment),
        "decisions": MetadataValue.md("\n".join(f"- {d.t_s / 3600:.2f} h: {d.reason}" for d in dyn.decisions[:50])
                                      or "no change"),
        **png_metadata(png, "fleet_day_devices_per_hour"),
    })
