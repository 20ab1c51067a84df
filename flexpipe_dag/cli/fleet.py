"""``flexpipe fleet``: plan a fleet's pipeline instances, the fleet gear for a load, and a day of the tide on them."""

from __future__ import annotations

import argparse
import json
import sys

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.settings import check_number
from flexpipe_dag.planner.operating import MAX_SLO_MS

#: Days of the bundled ServeGen tide.
TIDE_DAYS = 14


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "fleet", help="fleet gears: pipeline instances per host shape, the instances a load needs, a simulated day",
        description=__doc__.splitlines()[0].replace("``", ""),
        epilog="Hosts of one shape share one plan and one simulated envelope; every unit of hosts becomes an "
               "instance. Instances are listed best envelope per device first, and the fleet gear for a load is "
               "the shortest prefix holding it with the headroom (README, 'Fleet gears'). Exit status 1 when even "
               "the whole fleet does not hold --load-rps.")
    p.add_argument("--cluster", required=True, help="cluster profile (YAML / JSON; fleet form for large fleets)")
    p.add_argument("--model", required=True, help="built-in model name, a Hugging Face config.json directory, or a .gguf file")
    p.add_argument("--dtype", default="bf16", help="weight dtype (default bf16)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="time-to-first-token SLO, ms (default 2000)")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="time-per-output-token SLO, ms (default 200)")
    p.add_argument("--concurrency", type=int, default=64,
                   help="sequences in flight each instance's KV pool must hold (default 64)")
    p.add_argument("--context-p95", type=int, default=4096,
                   help="tokens (prompt + output) of each of those sequences (default 4096)")
    p.add_argument("--load-rps", type=float, default=None, help="print the fleet gear that holds this load, req/s")
    p.add_argument("--headroom", type=float, default=None,
                   help="with --load-rps or --day: share of the summed envelope held back, 0..0.9 (default the "
                        "scaler's, 0.10); the scaler gives instances back below 1 - (headroom + 0.1), at least 20 %%")
    p.add_argument("--day", type=int, default=None,
                   help=f"simulate day N (0..{TIDE_DAYS - 1}) of the bundled ServeGen tide, peak at --peak-share of the "
                        "fleet's envelope: the fleet scaler against the best static fleet gear")
    p.add_argument("--peak-share", type=float, default=None,
                   help="with --day: the day's peak as a share of the fleet envelope (default 0.8)")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from flexpipe_dag.cli.tables import new_table, plain_console
    from flexpipe_dag.control.fleet_scaler import FleetScalerConfig
    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.core.dtypes import canonical_dtype
    from flexpipe_dag.planner.fleet import FleetSettings, describe_plan, plan_fleet
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.workload import load_trace

    check_number(args.slo_ttft_ms, None, "--slo-ttft-ms", gt=0, le=MAX_SLO_MS, unit="milliseconds")
    check_number(args.slo_tpot_ms, None, "--slo-tpot-ms", gt=0, le=MAX_SLO_MS, unit="milliseconds")
    if args.load_rps is not None:
        check_number(args.load_rps, None, "--load-rps", ge=0, unit="req/s")
    if args.headroom is not None and args.load_rps is None and args.day is None:
        raise InputError(None, "--headroom", "applies to --load-rps or --day; give one of them")
    if args.peak_share is not None and args.day is None:
        raise InputError(None, "--peak-share", "applies to --day only")
    default = FleetScalerConfig()
    headroom = default.headroom_fraction if args.headroom is None else args.headroom
    check_number(headroom, None, "--headroom", ge=0, le=0.9, unit="fraction")
    scaler = FleetScalerConfig(headroom_fraction=headroom, scale_in_headroom_fraction=max(
        default.scale_in_headroom_fraction, min(0.95, headroom + 0.1)))
    if args.day is not None:
        check_number(args.day, None, "--day", integer=True, ge=0, le=TIDE_DAYS - 1, unit="tide day")
    peak_share = 0.8 if args.peak_share is None else args.peak_share
    check_number(peak_share, None, "--peak-share", gt=0, le=1.5, unit="fraction")
    dtype = canonical_dtype(args.dtype, None, "--dtype")
    cluster = load_cluster_profile(args.cluster)
    model = load_model_spec(args.model)
    reference = load_trace("azure-conv")
    check_number(args.concurrency, None, "--concurrency", integer=True, ge=1, le=1_000_000, unit="sequences")
    check_number(args.context_p95, None, "--context-p95", integer=True, ge=1, le=10**7, unit="tokens")
    settings = FleetSettings(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, concurrency=args.concurrency,
                             context_p95_tokens=args.context_p95)
    err = plain_console(stderr=True)
    with err.status(f"planning instances of {cluster.cluster_id}"):
        plan = plan_fleet(cluster, model, reference, dtype=dtype, settings=settings)
    out: dict[str, object] = {
        "cluster_id": cluster.cluster_id, "model": model.name, "rps_max": plan.rps_max,
        "num_instances": len(plan.instances), "templates": describe_plan(plan), "notes": list(plan.notes),
        "instances": [{"instance_id": i.instance_id, "hosts": list(i.host_ids), "devices": i.num_devices,
                       "rps_max": i.rps_max} for i in plan.instances]}
    if args.load_rps is not None:
        gear = plan.gear_for(args.load_rps, headroom)
        out["fleet_gear"] = {"fleet_gear_id": gear.fleet_gear_id, "load_rps": args.load_rps, "headroom": headroom,
                             "rps_max": gear.rps_max, "devices": gear.num_devices,
                             "holds": gear.holds(args.load_rps, headroom),
                             "instances": [{"instance_id": i.instance_id, "hosts": list(i.host_ids), "devices": i.num_devices,
                                            "rps_max": i.rps_max, "gear": i.gear.model_dump(mode="json")}
                                           for i in gear.instances]}
    if args.day is not None:
        out["day"] = _day(plan, settings, reference, args.day, peak_share, scaler, err)
    holds = not isinstance(out.get("fleet_gear"), dict) or bool(out["fleet_gear"]["holds"])  # type: ignore[index]
    if args.json:
        print(json.dumps(out, indent=2))
        return _exit_status(holds, args.load_rps, len(plan.instances), plan.rps_max, headroom)
    console = plain_console(width=max(120, Console().width))
    table = new_table(f"{cluster.cluster_id}: {len(plan.instances)} instances of {model.name}, fleet envelope "
                      f"{plan.rps_max:,.1f} req/s", ["like host", "instances", "hosts each", "devices each", "stages",
                                                      "micro-batch", "rps_max", "req/s per device"], ids=["like host"])
    for row in describe_plan(plan):
        table.add_row(str(row["like_host"]), str(row["instances"]), str(row["hosts_per_instance"]),
                      str(row["devices_per_instance"]), str(row["stages"]), str(row["micro_batch_size"]),
                      f"{row['rps_max']:.2f}", f"{row['rps_per_device']:.3f}")
    console.print(table)
    for note in plan.notes:
        console.print(f"note: {note}")
    if "fleet_gear" in out:
        g = out["fleet_gear"]
        assert isinstance(g, dict)
        verdict = ("holds it" if g["holds"] else
                   f"does NOT hold it: all {len(plan.instances)} instances of the fleet hold {plan.rps_max:,.1f} req/s "
                   f"x (1 - {headroom:g})")
        console.print(f"{g['fleet_gear_id']} for {args.load_rps:g} req/s with {headroom:.0%} headroom: "
                      f"{_count(len(g['instances']), 'instance')}, {_count(g['devices'], 'device')}, envelope "
                      f"{g['rps_max']:,.1f} req/s; {verdict}")
    if "day" in out:
        day = out["day"]
        assert isinstance(day, dict)
        console.print(f"tide day {args.day}, peak {day['peak_rps']:,.1f} req/s ({peak_share:g} x the fleet's envelope), "
                      f"SLO TTFT {args.slo_ttft_ms:g} ms / TPOT {args.slo_tpot_ms:g} ms, headroom {headroom:g}:")
        for row in day["policies"]:
            console.print(f"  {row['policy']:11s} attainment {row['slo_attainment']:.4f}, device-hours "
                          f"{row['device_hours']:,.0f}, mean / peak devices {row['mean_held_devices']:.0f} / "
                          f"{row['peak_held_devices']}, shifts/h {row['shifts_per_hour']:.2f}")
        console.print(f"  dynamic / best static device-hours: {day['device_hours_vs_best_static']:.3f} (bound: "
                      f"{day['bound_vs_best_static']:.3f}, the fewest instances each minute at 100 % of their "
                      "envelopes, started instantly)")
    return _exit_status(holds, args.load_rps, len(plan.instances), plan.rps_max, headroom)


def _exit_status(holds: bool, load_rps: float | None, instances: int, rps_max: float, headroom: float) -> int:
    """0, or (the whole fleet does not hold ``load_rps``) 1 with one line on stderr, as ``plan`` says it."""
    if holds:
        return 0
    print(f"flexpipe fleet: infeasible: {load_rps:g} req/s exceeds what all {instances} instances hold with "
          f"{headroom:.0%} headroom ({rps_max:,.1f} req/s x (1 - {headroom:g}))", file=sys.stderr)
    return 1


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _day(plan, settings, reference, day: int, peak_share: float, scaler, err) -> dict[str, object]:
    from flexpipe_dag.control.fleet_day import compare_day
    from flexpipe_dag.planner.fleet_curve import measure_attainment_curves

    with err.status("measuring attainment curves"):
        curves = measure_attainment_curves(plan, reference, settings)
    run = compare_day(plan, curves, day, peak_rps=peak_share * plan.rps_max, settings=settings, scaler_config=scaler)
    return {"tide_day": day, "peak_share": peak_share, "peak_rps": run.peak_rps,
            "headroom": scaler.headroom_fraction, "scale_in_headroom": scaler.scale_in_headroom_fraction,
            "slo_ttft_ms": settings.slo_ttft_ms, "slo_tpot_ms": settings.slo_tpot_ms,
            "policies": [run.dynamic.summary(), run.static.summary()],
            "device_hours_vs_best_static": run.device_hours_ratio, "bound_vs_best_static": run.bound_ratio}
