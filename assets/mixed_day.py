"""The ``mixed_day`` asset: a day of online tide plus an offline backlog on the fleet, three policies.

Static (the peak gear all day), dynamic (the gear-shift controller, offline on the devices each gear
frees) and the per-window oracle (:mod:`flexpipe_dag.control.mixed_day`), for the configured model
and SLO (the ``planning`` resource) on the cluster file of the run config, else the newest stored
profile. Metadata: the reservation curve and offline tokens over the day (PNG, inline and as a file),
the per-policy figures, the goal lines, and the HTML report's path.
"""

from typing import Literal

import pandas as pd
from dagster import AssetExecutionContext, Config, MaterializeResult, MetadataValue, asset
from pydantic import Field

from flexpipe_dag.assets.metadata import cluster_for_run, png_metadata, table_metadata
from flexpipe_dag.resources.planning import PlanningSettings
from flexpipe_dag.resources.store_resource import StoreResource


class MixedDayConfig(Config):
    """Run config of ``mixed_day`` (units in the names)."""

    cluster_file: str = Field(default="", description="cluster YAML; empty = the newest stored cluster profile")
    start_day: int = Field(default=0, ge=0, le=13, description="day of the 14-day ServeGen tide")
    duration_s: float = Field(default=7200.0, gt=0, le=86400.0, description="simulated seconds the day is compressed into")
    peak_share: float = Field(default=0.95, gt=0, le=1.5, description="the tide's peak as a share of the largest envelope")
    peak_rps: float = Field(default=0.0, ge=0, description="the tide's peak, req/s (0 = peak_share x the largest "
                                                         "envelope)")
    gears_from: Literal["sim", "planner"] = Field(default="sim", description="operating gears chosen by simulation "
                                                  "from the planner's shortlist, or the planner's analytic picks")
    offline_trace: str = Field(default="arxiv-summarization", description="offline backlog: bundled name or file")
    offline_limit: int = Field(default=0, ge=0, description="use only the first N offline jobs (0 = all)")
    cycle_backlog: bool = Field(default=True, description="repeat the backlog without end (it outlasts the day)")


@asset(group_name="mixed_day", deps=["gpu_profile"], description="A day of online tide plus an offline backlog: static vs dynamic shifting "
                                          "vs the per-window oracle; reservation curve and offline tokens over the day.")
def mixed_day(context: AssetExecutionContext, config: MixedDayConfig, planning: PlanningSettings,
              store: StoreResource) -> MaterializeResult:
    from flexpipe_dag.control import Controller
    from flexpipe_dag.control.day_setting import day_setting, leave_one_out_forecast, operating_gears
    from flexpipe_dag.control.mixed_day import goals, mixed_day_controller_config, run_mixed_day
    from flexpipe_dag.core.settings import flexpipe_home
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.serving.mixed_day_report import mixed_day_figures, write_mixed_day_report
    from flexpipe_dag.workload import Workload, load_trace

    cluster = cluster_for_run(config.cluster_file, store)
    spec = load_model_spec(planning.model)
    backlog = load_trace(config.offline_trace)
    if config.offline_limit:
        backlog = Workload(backlog.name, backlog.requests[: config.offline_limit], backlog.source, backlog.meta)
    gears = operating_gears(cluster, spec, dtype=planning.dtype, slo_ttft_ms=planning.slo_ttft_ms,
                            slo_tpot_ms=planning.slo_tpot_ms, source=config.gears_from)
    setting = day_setting(cluster, spec, planning.dtype, gears, start_day=config.start_day,
                          duration_s=config.duration_s, slo_ttft_ms=planning.slo_ttft_ms,
                          slo_tpot_ms=planning.slo_tpot_ms, peak_share=config.peak_share,
                          peak_rps=config.peak_rps or None)
    day = run_mixed_day(setting, Controller(mixed_day_controller_config(planning.slo_ttft_ms)), backlog,
                        cycle_backlog=config.cycle_backlog,
                        forecast=leave_one_out_forecast(config.start_day, config.duration_s))
    title = f"{spec.name} on {cluster.cluster_id}, tide day {config.start_day}"
    report = write_mixed_day_report(flexpipe_home() / "reports" / f"mixed_day_day{config.start_day}.html",
                                    f"mixed day: {title}", day, notes=gears.notes)
    figures = mixed_day_figures(day, title)
    table = pd.DataFrame([{k: v for k, v in p.items() if k not in ("reservation_curve_devices", "notes")}
                          for p in day.to_dict()["policies"].values()])
    goal_lines = [f"- {g.name}: {g.value:.4g} ({g.bar}): {'met' if g.met else 'NOT met'}" for g in goals(day)]
    context.log.info("mixed day %s: %s", title, "; ".join(goal_lines))
    dyn = day.policies["dynamic"]
    return MaterializeResult(metadata={
        "policies": table_metadata(table),
        "goals": MetadataValue.md("\n".join(goal_lines)),
        "reservation_share_of_static": MetadataValue.float(day.share_of_static("dynamic")),
        "offline_tokens_vs_static": MetadataValue.float(day.offline_vs_static("dynamic")),
        "online_slo_attainment": MetadataValue.float(dyn.attainment),
        "shifts": MetadataValue.int(dyn.shifts),
        "lost": MetadataValue.int(dyn.online_lost + dyn.offline.lost + dyn.offline.duplicated),
        "report": MetadataValue.path(str(report)),
        **png_metadata(figures["reservation_curve"], "mixed_day_reservation_curve"),
        **png_metadata(figures["offline_tokens"], "mixed_day_offline_tokens"),
    })
