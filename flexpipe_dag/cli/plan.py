"""``flexpipe plan``: the latency / balanced / throughput gears for a model on a cluster, envelopes measured at your SLO."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.core.dtypes import DTYPE_NAMES, canonical_dtype
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.settings import INT32_MAX, check_number
from flexpipe_dag.planner.envelope import CONFIRM_PROBE_S
from flexpipe_dag.planner.operating import (
    DEFAULT_ATTAINMENT,
    DEFAULT_CONCURRENCY,
    DEFAULT_MIN_RESIDENCE_S,
    DEFAULT_REFERENCE_REQUESTS,
    DEFAULT_REFERENCE_TRACE,
    DEFAULT_SLO_TPOT_MS,
    DEFAULT_SLO_TTFT_MS,
    MAX_SLO_MS,
    RECOMMENDED_HEADROOM,
)


def _dtype(name: str) -> str:
    """argparse type: a dtype name or alias -> its canonical name."""
    try:
        return canonical_dtype(name, None, "--dtype")
    except InputError as exc:
        raise argparse.ArgumentTypeError(exc.problem) from None


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="plan the operating gears for a model on a cluster, envelopes measured at your SLO",
                              description=__doc__.splitlines()[0].replace("``", ""),
                              epilog="Every envelope (rps_min..rps_max) is the highest rate of the reference trace the "
                                     "gear serves with --attainment of requests within --slo-ttft-ms / --slo-tpot-ms, "
                                     "measured in the simulator. Defaults are the Dagster planning defaults; "
                                     "FLEXPIPE_SLO_TTFT_MS, FLEXPIPE_SLO_TPOT_MS, FLEXPIPE_SLO_ATTAINMENT, "
                                     "FLEXPIPE_PLAN_DTYPE, FLEXPIPE_PLAN_CONCURRENCY, FLEXPIPE_REFERENCE_REQUESTS and "
                                     "FLEXPIPE_STAGE_REPLICAS set them for both.")
    p.add_argument("--cluster", required=True, help="cluster profile file (.yaml / .json; native, seed or fleet form)")
    p.add_argument("--model", required=True,
                   help="built-in model name, a Hugging Face config.json directory, or a .gguf file")
    p.add_argument("--dtype", default=None, type=_dtype, metavar="{" + ",".join(DTYPE_NAMES) + "}",
                   help="weight dtype (float32 / bfloat16 / float16 also read; default bf16)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help=f"TTFT SLO, ms (default {DEFAULT_SLO_TTFT_MS:g})")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help=f"TPOT SLO, ms (default {DEFAULT_SLO_TPOT_MS:g})")
    p.add_argument("--attainment", type=float, default=None,
                   help=f"share of requests that must meet the SLO, 0..1 (default {DEFAULT_ATTAINMENT:g})")
    p.add_argument("--load-rps", type=float, default=None,
                   help="expected load, req/s: the gear to run for it is marked recommended, with its headroom")
    p.add_argument("--trace", default=None,
                   help=f"reference trace envelopes are measured on (bundled name or file; default {DEFAULT_REFERENCE_TRACE})")
    p.add_argument("--requests", type=int, default=None,
                   help=f"requests of the trace replayed per envelope probe (default {DEFAULT_REFERENCE_REQUESTS})")
    p.add_argument("--objective", choices=("speed", "devices"), default=None,
                   help="speed (default): latency = lowest TPOT at low load; devices: fewest devices for each slot")
    p.add_argument("--context-p95", type=int, default=None,
                   help="P95 context tokens (prompt + output) the KV pool is sized for (default: the trace's P95, "
                        "at most the model's max context)")
    p.add_argument("--concurrency", type=int, default=None,
                   help=f"sequences in flight the KV pool must hold (default {DEFAULT_CONCURRENCY})")
    p.add_argument("--min-residence-s", type=float, default=None,
                   help=f"devices whose available_until is sooner are not used (default {DEFAULT_MIN_RESIDENCE_S:g})")
    p.add_argument("--bf16-fallback", choices=("fp16", "exclude", "refuse"), default=None,
                   help="bf16 requested on devices without it (V100, T4): fp16 (default) runs a gear using them in fp16, "
                        "exclude leaves those devices out, refuse stops; also FLEXPIPE_BF16_FALLBACK")
    p.add_argument("--no-replicas", action="store_true",
                   help="no stage replicas (one device per stage); also FLEXPIPE_STAGE_REPLICAS=0")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def check_context_p95(requested: int | None, model) -> None:
    """Refuse ``--context-p95`` when it is not an integer >= 1 or exceeds the model's max context
    (``max_position_embeddings`` / GGUF ``context_length``), naming both; unset, the P95 is the
    reference trace's under the model's context rule and nothing is checked here.

    Raises:
        InputError: as above.
    """
    if requested is None:
        return
    check_number(requested, None, "--context-p95", integer=True, ge=1, le=INT32_MAX, unit="tokens")
    max_ctx = model.max_context_tokens
    if max_ctx and requested > max_ctx:
        raise InputError(None, "--context-p95", f"{requested} tokens exceeds {model.name}'s max context of {max_ctx} "
                         f"tokens ({model.source}); expected 1..{max_ctx}")


def check_flags(args: argparse.Namespace) -> None:
    """Refuse a bad numeric flag before any file is read.

    Raises:
        InputError: naming the flag and the expected range.
    """
    checks: tuple[tuple[str, float | None, dict[str, Any]], ...] = (
              ("--concurrency", args.concurrency, {"integer": True, "ge": 1, "le": INT32_MAX, "unit": "sequences"}),
              ("--min-residence-s", args.min_residence_s, {"ge": 0, "unit": "seconds"}),
              ("--context-p95", args.context_p95, {"integer": True, "ge": 1, "le": INT32_MAX, "unit": "tokens"}),
              ("--slo-ttft-ms", args.slo_ttft_ms, {"gt": 0, "le": MAX_SLO_MS, "unit": "milliseconds"}),
              ("--slo-tpot-ms", args.slo_tpot_ms, {"gt": 0, "le": MAX_SLO_MS, "unit": "milliseconds"}),
              ("--attainment", args.attainment, {"gt": 0, "le": 1, "unit": ""}),
              ("--load-rps", args.load_rps, {"ge": 0, "unit": "req/s"}),
              ("--requests", args.requests, {"integer": True, "ge": 50, "le": INT32_MAX, "unit": "requests"}))
    for flag, value, bounds in checks:
        if value is not None:
            check_number(value, None, flag, **bounds)


#: CLI flag -> PlanningSettings field (flags left unset keep the environment's or the default value).
FLAG_FIELDS = {"dtype": "dtype", "slo_ttft_ms": "slo_ttft_ms", "slo_tpot_ms": "slo_tpot_ms", "attainment": "attainment",
               "load_rps": "load_rps", "trace": "reference_trace", "requests": "reference_requests",
               "objective": "objective", "context_p95": "context_p95_tokens", "concurrency": "concurrency",
               "min_residence_s": "min_residence_s", "bf16_fallback": "bf16_fallback"}


def planning_settings(args: argparse.Namespace):
    """The Dagster planning resource as these flags and the environment set it (one set of defaults).

    Raises:
        InputError: a bad environment variable or flag (named).
    """
    from flexpipe_dag.resources.planning import settings_from_env

    overrides = {name: getattr(args, flag) for flag, name in FLAG_FIELDS.items()}
    overrides["model"] = args.model
    if args.no_replicas:
        overrides["stage_replicas"] = False
    return settings_from_env(overrides, names={name: f"--{flag.replace('_', '-')}" for flag, name in FLAG_FIELDS.items()})


def run(args: argparse.Namespace) -> int:
    from flexpipe_dag.cli.tables import plain_console
    from flexpipe_dag.planner.model_spec import load_model_spec

    check_flags(args)
    settings = planning_settings(args)
    cluster = load_cluster_profile(args.cluster)
    model = load_model_spec(args.model)
    check_context_p95(args.context_p95, model)
    err = plain_console(stderr=True)  # the spinner; results go to stdout
    with err.status("planning") as status:
        plan = settings.plan(cluster, model, progress=lambda line: status.update(line))
    if args.json:
        print(json.dumps(plan_json(plan, cluster.cluster_id, model.summary(settings.dtype)), indent=2))
    else:
        print_plan(plan, cluster.cluster_id, model.name, settings.dtype)
    problem = infeasibility(plan)
    if problem:
        print(f"flexpipe plan: infeasible: {problem}", file=sys.stderr)
        return 1
    return 0


def infeasibility(plan) -> str | None:
    """Why the plan cannot serve what was asked (the exit status is then 1), or None: no gear has an envelope (no
    load meets the SLO on any of them), or ``--load-rps`` is above every gear's envelope."""
    if not any(g.rps_max > 0 for g in plan.gears):
        return (f"no gear meets the SLO ({plan.basis.describe()}) at any load; relax the SLO or add devices "
                f"(the gears are listed for reference, each with envelope 0)")
    rec = plan.recommendation
    if rec is not None and not rec.holds:
        return rec.reason  # "no gear holds R req/s: the largest envelope ..."
    return None


def plan_json(plan, cluster_id: str, model_summary: dict) -> dict:
    """The plan as plain JSON: gears (with envelope basis), recommendation, candidates, workload, timing."""
    rec = plan.recommendation
    return {"cluster_id": cluster_id, "model": model_summary, "envelope_basis": plan.basis.model_dump(),
            "feasible": infeasibility(plan) is None,
            "workload": dataclasses.asdict(plan.workload),
            "gears": [g.model_dump(mode="json") for g in plan.gears],
            "analytic_rps_max": plan.analytic_rps_max,
            "recommended": dataclasses.asdict(rec) if rec else None,
            "candidates": [{"gear_id": e.gear_id, "rps_max": e.rps_max, "confirmed": e.confirmed, "probes": len(e.probes)}
                           for e in plan.envelopes],
            "notes": plan.notes, "planning_wall_s": round(plan.wall_s, 3), "simulations": plan.probes}




def print_plan(plan, cluster_id: str, model_name: str, dtype: str, console=None) -> None:
    """Human output of an :class:`~flexpipe_dag.planner.operating.OperatingPlan`: the gear tables, what the
    envelopes mean, the recommendation for the load, notes and what planning cost."""
    from flexpipe_dag.cli.tables import cli_console, format_number

    console = console or cli_console()
    rec = plan.recommendation
    _print_table(cluster_id, model_name, dtype, plan.gears, console, analytic=plan.analytic_rps_max,
                 recommended=rec.gear_id if rec and rec.holds else None,
                 caption=f"envelope = highest rate served with {plan.basis.describe()}, "
                         f"{plan.basis.num_requests} requests per probe, held for {CONFIRM_PROBE_S:.0f} s on two "
                         "samples of the trace; TTFT, TPOT and tokens/s are measured at the envelope's top")
    if rec and rec.holds:
        console.print(f"load {format_number(rec.load_rps, 2)} req/s: run {rec.gear_id} "
                      f"(headroom {rec.headroom_fraction:.0%}). {rec.reason}")
        if rec.headroom_fraction < RECOMMENDED_HEADROOM:
            console.print(f"warning: {rec.headroom_fraction:.0%} headroom is under the {RECOMMENDED_HEADROOM:.0%} the "
                          "envelope's promise is checked at (attainment >= 0.9 at 80 % of rps_max)")
    elif rec:
        console.print(f"load {format_number(rec.load_rps, 2)} req/s: {rec.reason}")
    for note in plan.notes:
        console.print(f"note: {note}")
    screened = sum(1 for e in plan.envelopes if e.screened)
    left_out = f" ({screened} left out unmeasured)" if screened else ""
    console.print(f"{len(plan.candidate_ids) - screened} of {len(plan.candidate_ids)} candidates measured{left_out}, "
                  f"{plan.probes} simulations, {format_number(plan.wall_s, 1)} s")


def _print_table(cluster_id: str, model_name: str, dtype: str, gears, console=None, *,
                 analytic: dict[str, float] | None = None, recommended: str | None = None,
                 caption: str | None = None) -> None:
    """The gear summary table (ids never cut, figures apart at any magnitude), then each gear's stages.

    ``analytic``: each gear's analytic envelope, shown beside the measured one; ``recommended``: the
    gear id marked ``*`` (explained in the caption).
    """
    from flexpipe_dag.cli.tables import cli_console, format_number, format_pair, format_range, new_table

    console = console or cli_console()
    cols = ["gear", "devices", "stages", "micro-batch", "dtype", "envelope req/s", "analytic req/s",
            "TTFT p50/p99 ms", "TPOT p50/p99 ms", "tokens/s", "KV tokens"]
    title = f"gears for {model_name} ({dtype} requested) on {cluster_id}"
    summary = new_table(title, cols, ids=["gear"], text=["dtype"])
    if caption or recommended:
        summary.caption = " ".join(x for x in (caption, "* recommended for the load" if recommended else None) if x)
    for g in gears:
        e = g.estimate
        mark = "*" if recommended == g.gear_id else ""
        summary.add_row(g.gear_id + mark, str(len(g.device_ids)), str(g.num_stages), str(g.micro_batch_size), g.dtype,
                        format_range(g.rps_min, g.rps_max, 2),
                        format_number((analytic or {}).get(g.gear_id), 2),
                        format_pair(e.ttft_p50_ms, e.ttft_p99_ms, 0) if e else "-",
                        format_pair(e.tpot_p50_ms, e.tpot_p99_ms, 1) if e else "-",
                        format_number(e.tokens_per_s, 0) if e else "-", format_number(g.kv_capacity_tokens))
    console.print(summary)
    for g in gears:
        t = new_table(f"{g.gear_id} stages", ["stage", "layers", "devices", "est ms/step", "weights GiB", "KV tokens"],
                      text=["layers", "devices"])
        for st in g.stages:
            t.add_row(str(st.stage_index), f"{st.layer_start}-{st.layer_end - 1} ({st.num_layers})",
                      ", ".join(st.device_ids), format_number(st.est_stage_ms, 2), format_number(st.weight_gib, 2),
                      format_number(st.kv_capacity_tokens))
        console.print(t)
