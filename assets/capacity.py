"""Capacity asset: ``capacity_plan``, the cards (per GPU type and the cheapest mix) the forecast peak needs."""

import pandas as pd
from dagster import AssetExecutionContext, Config, MaterializeResult, MetadataValue, asset
from pydantic import Field

from flexpipe_dag.assets.metadata import table_metadata
from flexpipe_dag.planner.capacity_math import DEFAULT_RESERVE, RESERVE_MAX, RESERVE_MIN
from flexpipe_dag.resources.control import ControlSettings
from flexpipe_dag.resources.planning import PlanningSettings


class CapacityConfig(Config):
    """What to plan for beyond the planning resource (model, dtype, SLO, trace) and the tide history."""

    gpu_types: str = Field(default="", description="comma-separated catalog GPU types; empty = every priced type")
    price_file: str = Field(default="", description="price file (per_gpu_hour); empty = the bundled example prices")
    reserve: float = Field(default=DEFAULT_RESERVE, ge=RESERVE_MIN, le=RESERVE_MAX,
                           description="memory kept free per card and envelope headroom per instance")
    peak_rps: float = Field(default=0.0, ge=0, description="load to plan for, req/s; 0 = the forecast peak of the "
                                                           "tide history (see forecast_peak_rps)")


def forecast_peak_rps(history, load_rps: float | None) -> tuple[float, str]:
    """The load forecast: the peak of the tide history's daily profile, at the configured level.

    With ``load_rps`` (the planning resource's expected load, taken as the day's mean level) the
    profile is scaled to it, ``load_rps x peak / mean`` (the seasonal-naive scaling of
    :class:`~flexpipe_dag.control.tide.TideForecaster`); without it the history's own peak.

    Returns:
        ``(peak_rps, how)``: the forecast and one sentence saying how it was made.
    """
    profile = history.daily_profile()
    peak, mean = float(profile.max()), float(profile.mean())
    if load_rps:
        return load_rps * peak / mean, (f"tide peak / mean {peak / mean:.3f} x configured load {load_rps:g} req/s "
                                        f"({history.source or 'tide history'})")
    return peak, f"peak of the tide history's daily profile ({history.source or 'tide history'})"


@asset(group_name="capacity", description="Cards per GPU type and the cheapest mix (exact ILP) that serve the model at "
                                          "the SLO for the forecast peak of the tide with the reserve, confirmed in "
                                          "the simulator; the arithmetic step by step in the metadata.")
def capacity_plan(context: AssetExecutionContext, config: CapacityConfig, planning: PlanningSettings,
                  control: ControlSettings) -> MaterializeResult:
    from flexpipe_dag.control.tide import load_history
    from flexpipe_dag.planner.capacity import capacity_report
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.planner.prices import load_prices

    if config.peak_rps > 0:
        load, how = config.peak_rps, "configured peak_rps"
    else:
        load, how = forecast_peak_rps(load_history(control.tide_config()), planning.load_rps)
    context.log.info(f"planning capacity for {load:.3f} req/s ({how})")
    model = load_model_spec(planning.model)
    plan = capacity_report(
        model, planning.capped_reference_trace(), load_prices(config.price_file or None), load_rps=load,
        slo_ttft_ms=planning.slo_ttft_ms, slo_tpot_ms=planning.slo_tpot_ms, dtype=planning.dtype,
        context_p95_tokens=planning.context_p95_tokens, reserve_fraction=config.reserve,
        gpu_types=[t.strip() for t in config.gpu_types.split(",") if t.strip()] or None,
        confirm_requests=planning.reference_requests, progress=context.log.info)
    data = plan.to_dict()
    rows = [{"fleet": f"{t['gpu_type']} alone", "cards": (t["plan"] or {}).get("cards"),
             "cost_per_hour": (t["plan"] or {}).get("cost_per_hour"),
             "cost_per_million_output_tokens": (t["plan"] or {}).get("cost_per_million_output_tokens"),
             "rps_with_reserve": (t["plan"] or {}).get("rps_with_reserve")} for t in data["types"]]
    mix = data["mix"]
    rows.append({"fleet": "cheapest mix", "cards": mix["cards"], "cost_per_hour": mix["cost_per_hour"],
                 "cost_per_million_output_tokens": mix["cost_per_million_output_tokens"],
                 "rps_with_reserve": mix["rps_with_reserve"]})
    conf = data["confirmation"]
    return MaterializeResult(metadata={
        "model": model.name, "load_rps": load, "load_forecast": how,
        "cards": int(mix["cards"]), "cards_by_type": MetadataValue.json(mix["cards_by_type"]),
        "cost_per_hour": float(mix["cost_per_hour"]), "currency": plan.currency,
        "cost_per_million_output_tokens": float(mix["cost_per_million_output_tokens"]),
        "simulated_slo_attainment": float(conf["slo_attainment"]) if conf else float("nan"),
        "fleets": table_metadata(pd.DataFrame(rows)),
        "steps": MetadataValue.md("\n".join(f"- {line}" for line in data["steps"])),
        "plan": MetadataValue.json(data),
    })
