"""``flexpipe capacity``: how many (and which) cards serve a model at a load and an SLO, with the reserve."""

from __future__ import annotations

import argparse
import json
import sys

from flexpipe_dag.core.errors import InfeasibleError, InputError, one_line
from flexpipe_dag.core.settings import INT32_MAX, check_number, env_value
from flexpipe_dag.planner.capacity_math import DEFAULT_RESERVE, check_reserve
from flexpipe_dag.planner.operating import DEFAULT_REFERENCE_REQUESTS, DEFAULT_REFERENCE_TRACE, MAX_SLO_MS

#: Exit status of a request no card type can serve within the SLO (bad input exits 2, as every command).
EXIT_INFEASIBLE = 1
#: ``--load-rps`` range: below one request a day the per-token cost is not a number anyone buys cards by (at
#: 5e-324 req/s it was infinite and the JSON carried ``Infinity``); above, no fleet.
MIN_LOAD_RPS, MAX_LOAD_RPS = 1e-5, 1e7


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "capacity", help="cards per GPU type and the cheapest mix for a model at a load and an SLO",
        description=__doc__.splitlines()[0].replace("``", ""),
        epilog="Concurrency comes from Little's law (load x (TTFT + output P95 x TPOT)); each pipeline instance is "
               "planned by the gear planner and loaded to at most (1 - reserve) of its analytic SLO envelope; the "
               "cheapest mix is an exact integer program over instances. The chosen fleet is replayed in the "
               "simulator on the trace. Exit status 1: no card type meets the SLO (the reason is printed).")
    p.add_argument("--model", required=True, help="built-in model name, a Hugging Face config.json directory, or a .gguf file")
    p.add_argument("--dtype", default="bf16", help="weight dtype (default bf16; fp16 on cards without bf16)")
    p.add_argument("--slo-ttft-ms", type=float, required=True, help="time-to-first-token SLO, ms")
    p.add_argument("--slo-tpot-ms", type=float, required=True, help="time-per-output-token SLO, ms")
    p.add_argument("--load-rps", type=float, required=True, help="load to serve, req/s")
    p.add_argument("--trace", default=None,
                   help=f"request trace (bundled name or file) for the mean lengths, the P95s and the simulator replay "
                        f"(default {DEFAULT_REFERENCE_TRACE})")
    p.add_argument("--context-p95", type=int, default=None, help="P95 prompt + output tokens (default: the trace's)")
    p.add_argument("--output-p95", type=int, default=None, help="P95 output tokens (default: the trace's)")
    p.add_argument("--gpu-types", default=None,
                   help="comma-separated catalog GPU models, e.g. A100-SXM-80GB,L4,T4 (default: every priced type)")
    p.add_argument("--price-file", default=None,
                   help="YAML / JSON with per_gpu_hour: {GPU type: price} (default: the bundled example prices)")
    p.add_argument("--reserve", type=float, default=DEFAULT_RESERVE,
                   help=f"memory kept free per card and envelope headroom per instance, 0.10..0.15 (default {DEFAULT_RESERVE:g})")
    p.add_argument("--requests", type=int, default=None,
                   help=f"trace requests replayed per instance in the simulator (default {DEFAULT_REFERENCE_REQUESTS}, "
                        "or FLEXPIPE_REFERENCE_REQUESTS; unused with --no-simulate)")
    p.add_argument("--no-simulate", action="store_true", help="skip the simulator replay")
    p.add_argument("--json", action="store_true", help="print the plan (with its steps) as JSON")
    p.set_defaults(func=run)


def _gpu_types(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise InputError(None, "--gpu-types", f"expected comma-separated GPU types, got {text!r}")
    return names


def run(args: argparse.Namespace) -> int:
    from flexpipe_dag.cli.tables import plain_console
    from flexpipe_dag.core.dtypes import canonical_dtype
    from flexpipe_dag.planner.capacity import capacity_report
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.planner.operating import small_sample_warning
    from flexpipe_dag.planner.prices import load_prices
    from flexpipe_dag.workload.bundled import load_trace

    check_number(args.load_rps, None, "--load-rps", ge=MIN_LOAD_RPS, le=MAX_LOAD_RPS, unit="req/s")
    check_number(args.slo_ttft_ms, None, "--slo-ttft-ms", gt=0, le=MAX_SLO_MS, unit="milliseconds")
    check_number(args.slo_tpot_ms, None, "--slo-tpot-ms", gt=0, le=MAX_SLO_MS, unit="milliseconds")
    for flag, value in (("--context-p95", args.context_p95), ("--output-p95", args.output_p95)):
        if value is not None:
            check_number(value, None, flag, integer=True, ge=1, le=INT32_MAX, unit="tokens")
    reserve = check_reserve(args.reserve)
    if args.requests is not None:  # a count, even where --no-simulate ignores it (the simulator's minimum below)
        check_number(args.requests, None, "--requests", integer=True, ge=1, le=INT32_MAX, unit="requests")
    requests = None  # replays per instance: the simulator's alone, so --no-simulate ignores them
    if not args.no_simulate:
        requests = args.requests if args.requests is not None else env_value(
            "FLEXPIPE_REFERENCE_REQUESTS", int, DEFAULT_REFERENCE_REQUESTS, ge=50)
        check_number(requests, None, "--requests", integer=True, ge=50, le=INT32_MAX, unit="requests")
    dtype = canonical_dtype(args.dtype, None, "--dtype")
    prices = load_prices(args.price_file)
    model = load_model_spec(args.model)
    trace = load_trace(args.trace or DEFAULT_REFERENCE_TRACE)
    err = plain_console(stderr=True)
    try:
        with err.status("capacity planning") as status:
            plan = capacity_report(model, trace, prices, load_rps=args.load_rps, slo_ttft_ms=args.slo_ttft_ms,
                                   slo_tpot_ms=args.slo_tpot_ms, dtype=dtype, context_p95_tokens=args.context_p95,
                                   output_p95_tokens=args.output_p95, reserve_fraction=reserve,
                                   gpu_types=_gpu_types(args.gpu_types),
                                   confirm_requests=requests,
                                   progress=lambda line: status.update(line))
    except InfeasibleError as exc:
        print(f"flexpipe capacity: infeasible: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_INFEASIBLE
    small = None if requests is None else small_sample_warning(requests, trace.name, len(trace),
                                                                "the plan was confirmed on replays, per instance, of")
    if small:
        print(f"flexpipe capacity: warning: {small}", file=sys.stderr)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    print_capacity(plan)
    return 0


def print_capacity(plan, console=None) -> None:
    """Human output: one row per GPU type alone and one for the cheapest mix (instances as ``count x cards
    type``), then the steps."""
    from flexpipe_dag.cli.tables import cli_console, format_number, new_table

    console = console or cli_console()
    need = plan.need
    cur = plan.currency
    table = new_table(f"cards for {need.model_name} ({need.dtype}) at {need.load_rps:g} req/s, TTFT <= "
                      f"{need.slo_ttft_ms:g} ms, TPOT <= {need.slo_tpot_ms:g} ms, reserve {need.reserve_fraction:.0%}",
                      ["fleet", "cards", "instances", "envelope req/s", "with reserve", "KV tokens / need",
                       f"{cur}/h", f"{cur}/1M out tok"], ids=["fleet"], text=["instances"])

    def row(label: str, mix) -> None:
        if mix is None:
            table.add_row(label, "-", "no plan", "-", "-", "-", "-", "-")
            return
        inst = " + ".join(f"{k} x {o.cards} {o.gpu_type}" for o, k in mix.instances)
        table.add_row(label, str(mix.cards), inst, format_number(mix.rps_max, 2), format_number(mix.rps_with_reserve, 2),
                      f"{format_number(mix.kv_capacity_tokens)} / {format_number(need.kv_need_tokens)}",
                      format_number(mix.cost_per_hour, 2), format_number(plan.cost_per_million_output_tokens(mix), 3))

    for t in plan.types:
        row(t.gpu_type, t.mix)
    row("cheapest mix", plan.mix)
    table.caption = f"prices: {plan.price_source or 'user file'}"
    console.print(table)
    for line in plan.steps():
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    c = plan.confirmation
    if c is not None and not c.passed:
        console.print(f"warning: the simulator measured SLO attainment {c.slo_attainment:.3f} (lost {c.lost}) at "
                      f"{c.load_rps:g} req/s, under the promised {c.promised_attainment:g}", markup=False)
