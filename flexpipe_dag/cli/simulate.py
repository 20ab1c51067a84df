"""``flexpipe simulate``: replay a request trace through a gear and print what users would see.

Two ways to name the gear and its stage times:

* ``--cluster FILE --model MODEL --gear GEAR_ID|KIND``: the planner proposes gears for the cluster
  and model; the one with that id (or the first of that kind) is simulated with the planner's cost
  model (``CostModel.timings(gear)``).
* ``--gear-file GEAR.json|yaml --cluster FILE [--model MODEL]``: a gear written by hand or exported
  by ``flexpipe plan --json``, priced with the planner's cost model on that cluster (the model is
  the gear's ``model_name`` unless ``--model`` is given; the dtype the gear's unless ``--dtype``).
* ``--gear-file GEAR.json|yaml --timing STAGES.csv``: the same gear with measured stage times:
  a CSV with one row per stage (in stage order) and the linear-cost columns ``prefill_fixed_ms``,
  ``prefill_per_token_ms``, ``decode_fixed_ms``, ``decode_per_seq_ms``,
  ``decode_per_context_token_ms``, ``transfer_fixed_ms``, ``transfer_per_token_ms`` (ms; see
  ``flexpipe_dag.sim.timing``).

``--day``: the mixed-day simulation instead (see ``flexpipe_dag.cli.simulate_day``): a day of online
tide plus an offline backlog on ``--cluster`` for ``--model``, under static / dynamic / oracle policies.

TRACE is a file (Azure CSV, generic CSV / JSONL, length-only CSV) or a bundled name
(``azure-conv``, ``azure-code``, ``arxiv-summarization``).

Requests whose prompt + output exceed the model's maximum context (``--model``'s, or the gear's
``model_name`` when it is a built-in model; ``--max-context-tokens`` to set or lower it) are
rejected and counted (``rejected_context``); with ``--truncate-context`` they are served with the
prompt cut from the left and counted (``truncated_context``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import RenderableType
from rich.text import Text

from flexpipe_dag.cli.chunked_prefill import add_chunked_prefill_argument, chunked_prefill_tokens
from flexpipe_dag.cli.simulate_day import add_day_arguments, run_day
from flexpipe_dag.cli.tables import PIPE_WIDTH, IdTable, cli_console, format_number, new_table, render_text
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import OPERATING_KINDS, Gear
from flexpipe_dag.core.gear_builders import load_gear
from flexpipe_dag.core.settings import INT32_MAX, check_number
from flexpipe_dag.core.timing import StageTimingModel
from flexpipe_dag.sim import LinearStageTiming, SimConfig, Simulator
from flexpipe_dag.sim.engine import DrainHorizonError
from flexpipe_dag.sim.results import attainment_after_warmup
from flexpipe_dag.sim.timing import COST_FIELDS
from flexpipe_dag.workload import (
    BUNDLED_TRACES,
    Workload,
    as_class,
    load_tide_trace,
    load_trace,
    mix,
    shape_by_tide,
    speedup,
    time_window,
)
from flexpipe_dag.workload.transform import MAX_SPEEDUP, MIN_SPEEDUP


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("simulate", help="replay a request trace through a gear (TTFT, TPOT, goodput, utilisation)",
                              description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", help="cluster profile YAML (with --model and --gear, or to price --gear-file)")
    p.add_argument("--model", help="model name or config path (with --cluster; default with --gear-file: the gear's "
                                   "model_name; also gives the max context)")
    p.add_argument("--gear", help="gear id or kind (latency / balanced / throughput) among the planner's gears")
    p.add_argument("--dtype", default=None,
                   help="weight dtype for the cost model (default bf16; with --gear-file the gear's dtype)")
    p.add_argument("--gear-file", help="a Gear as JSON or YAML (instead of --gear), with --cluster or --timing")
    p.add_argument("--timing", metavar="STAGES.csv",
                   help="measured stage times for --gear-file: one row per stage, every one of the columns " + ", ".join(COST_FIELDS)
                        + " (ms; 0 where a cost does not apply); without it --cluster prices the gear with the planner's cost model")
    bundled = ", ".join(n for n in BUNDLED_TRACES if n != "servegen-tide")
    p.add_argument("--trace", help=f"trace file or bundled name ({bundled}); required unless --day")
    p.add_argument("--speedup", type=float, default=None, help="compress arrival times by this factor (default 1)")
    p.add_argument("--rate-rps", type=float, default=None,
                   help="replay at this mean arrival rate, req/s: the speedup is set from the trace's own mean rate "
                        "(after --window-s); e.g. a gear's rps_max, to check its envelope (instead of --speedup)")
    p.add_argument("--window-s", type=float, nargs=2, metavar=("START", "END"), help="only requests arriving in [START, END) s")
    p.add_argument("--tide-compression", type=float,
                   help="shape the trace by the bundled ServeGen daily tide, this many tide seconds per trace second")
    p.add_argument("--offline", help="also queue this length-only / request file as an offline backlog at 0 s")
    p.add_argument("--offline-limit", type=int, help="use only the first N offline jobs")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help=f"TTFT SLO, ms (default: the gear's envelope_basis, else {SimConfig.slo_ttft_ms:g})")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help=f"TPOT SLO, ms (default: the gear's envelope_basis, else {SimConfig.slo_tpot_ms:g})")
    p.add_argument("--micro-batch-size", type=int, help="override the gear's sequences per micro-batch")
    p.add_argument("--max-inflight", type=int, help="override the gear's max in-flight micro-batches")
    add_chunked_prefill_argument(p)
    p.add_argument("--kv-capacity-tokens", type=int, help="override the gear's KV pool size")
    p.add_argument("--max-context-tokens", type=int,
                   help="max context (prompt + output tokens) requests must fit; default the model's own, at most it")
    p.add_argument("--truncate-context", action="store_true",
                   help="serve requests over the max context with the prompt cut from the left (default: reject them)")
    p.add_argument("--timeseries-csv", help="write the 2 s metric samples (queue, KV use, stage busy) to this CSV")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_day_arguments(p)
    p.set_defaults(func=run)


def load_gear_file(path: str | Path) -> Gear:
    """Read a :class:`Gear` from JSON or YAML (:func:`~flexpipe_dag.core.gear_builders.load_gear`).

    Raises:
        InputError: missing file, unparsable, or a field that fails validation (named by path).
    """
    return load_gear(path)


def _planner_gear(args: argparse.Namespace) -> tuple[Gear, StageTimingModel]:
    """Plan the operating gears as ``flexpipe plan`` does (same settings, this command's SLO) and pick
    ``--gear`` by id or kind."""
    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.planner.cost_model import CostModel
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.resources.planning import settings_from_env

    settings = settings_from_env({"model": args.model, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
                                  "dtype": args.dtype or None},
                                 names={"slo_ttft_ms": "--slo-ttft-ms", "slo_tpot_ms": "--slo-tpot-ms", "dtype": "--dtype"})
    cluster = load_cluster_profile(args.cluster)
    model = load_model_spec(args.model)
    gears = settings.plan(cluster, model).gears
    chosen = next((g for g in gears if g.gear_id == args.gear), None) or next((g for g in gears if g.kind == args.gear), None)
    if chosen is None and args.gear in OPERATING_KINDS:
        raise InputError(None, "--gear", f"this plan has no {args.gear} gear (the planner keeps a kind only when it "
                         f"differs from the others); its gears: {[g.gear_id for g in gears]}")
    if chosen is None:
        raise InputError(None, "--gear", f"got {args.gear!r}; expected a kind {list(OPERATING_KINDS)} or one of "
                         f"{[g.gear_id for g in gears]}")
    cost_model = CostModel(model, cluster, dtype=chosen.dtype)
    return chosen, cost_model.timings(chosen)


def price_gear_file(gear: Gear, gear_path: str, cluster_path: str, model_name: str | None,
                    dtype: str | None) -> tuple[Gear, StageTimingModel]:
    """A gear read from ``gear_path`` sized on the cluster's devices, and its stage times from the planner's cost
    model there.

    The model is ``model_name`` (``--model``) or else the gear's ``model_name``; the dtype ``dtype``
    (``--dtype``) or else the gear's. The file's weights and KV pool are not trusted (it may have been edited):
    they are re-derived from the model and the devices (:func:`~flexpipe_dag.planner.verify.fit_gear_to_devices`),
    and each figure that differs is said on stderr.

    Raises:
        InputError: the cluster or model cannot be read (naming ``--model`` when the gear's own
            ``model_name`` is not a model FlexPipe can load), the gear's ``num_layers`` differs from
            the model's, a stage's device (or the link between adjacent stages) is not in the cluster, or a
            stage does not fit its device's memory in the dtype (bf16 on a device without it included).
    """
    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.planner.cost_model import CostModel
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.planner.verify import fit_gear_to_devices

    cluster = load_cluster_profile(cluster_path)
    if model_name:
        model = load_model_spec(model_name)
    else:
        try:
            model = load_model_spec(gear.model_name)
        except InputError as exc:
            raise InputError(None, "--model", f"the gear's model_name {gear.model_name!r} ({gear_path}) is not a model "
                             f"FlexPipe can load ({exc}); give --model NAME|CONFIG_DIR|FILE.gguf") from None
    if gear.num_layers != model.num_layers:
        raise InputError(gear_path, "num_layers", f"the gear has {gear.num_layers} layers but {model.name} has "
                         f"{model.num_layers}; expected a gear for {model.name} (or --model naming the gear's model)")
    cost_model = CostModel(model, cluster, dtype=dtype or gear.dtype)
    try:
        timing = cost_model.timings(gear)
    except InputError as exc:
        raise InputError(gear_path, exc.field, f"{exc.problem} ({cluster_path})") from None
    sized, changed = fit_gear_to_devices(gear, cluster, model, cost_model.dtype, source=gear_path)
    for line in changed:
        print(f"note: {gear_path}: {line}; simulated with the devices' figure", file=sys.stderr)
    return sized, timing


def _gear_and_timing(args: argparse.Namespace) -> tuple[Gear, StageTimingModel]:
    if args.gear_file:
        if args.gear:
            raise InputError(None, "--gear", "give --gear (a planner gear) or --gear-file (a gear from a file), not both")
        if args.timing and args.cluster:
            raise InputError(None, "--timing", "give --timing STAGES.csv (measured stage times) or --cluster FILE "
                             "(the cost model prices the gear), not both")
        if not args.timing and not args.cluster:
            raise InputError(None, "--timing", f"--gear-file {args.gear_file} needs stage times: give --cluster "
                             "CLUSTER.yaml [--model MODEL] to price the gear with the planner's cost model, or --timing "
                             f"STAGES.csv with one row per stage and columns {', '.join(COST_FIELDS)} (ms)")
        gear = load_gear_file(args.gear_file)
        if args.timing:
            timing = LinearStageTiming.from_csv(args.timing)
            if timing.num_stages != gear.num_stages:
                raise InputError(args.timing, "stages", f"{timing.num_stages} row(s); expected one per stage of "
                                                        f"{args.gear_file} ({gear.num_stages})")
            return gear, timing
        return price_gear_file(gear, args.gear_file, args.cluster, args.model, args.dtype)
    missing = [f"--{n}" for n in ("cluster", "model", "gear") if not getattr(args, n)]
    if missing:
        raise InputError(None, missing[0], "give --cluster, --model and --gear; or --gear-file with --cluster "
                         "(cost model) or --timing STAGES.csv (measured stage times)")
    return _planner_gear(args)


def check_flags(args: argparse.Namespace) -> None:
    """Refuse bad numeric flags before any file is read or anything is simulated.

    Raises:
        InputError: naming the flag and what was expected (``--speedup`` 0.001..1e6, ``--window-s`` START >= 0
            and END > START, ``--tide-compression`` > 0, ``--offline-limit`` >= 1 and only with
            ``--offline``, SLOs > 0, micro-batch / in-flight / KV overrides >= 1, a writable
            ``--timeseries-csv`` path, a known ``--dtype``, ``--chunked-prefill-tokens`` 1..2**20).
    """
    from flexpipe_dag.core.dtypes import canonical_dtype

    if args.dtype is not None:
        args.dtype = canonical_dtype(args.dtype, None, "--dtype")
    chunked_prefill_tokens(args)
    if args.speedup is not None:  # None: not given, the trace's own pace
        check_number(args.speedup, None, "--speedup", ge=MIN_SPEEDUP, le=MAX_SPEEDUP, unit="factor")
    if getattr(args, "rate_rps", None) is not None:
        if args.speedup is not None:
            raise InputError(None, "--rate-rps", "give --rate-rps or --speedup, not both (the rate sets the speedup)")
        check_number(args.rate_rps, None, "--rate-rps", gt=0, unit="req/s")
    if args.window_s:
        start_s, end_s = args.window_s
        check_number(start_s, None, "--window-s START", ge=0, unit="trace seconds")
        check_number(end_s, None, "--window-s END", gt=start_s, finite=False, unit="trace seconds")
    if args.tide_compression is not None:
        check_number(args.tide_compression, None, "--tide-compression", gt=0, unit="tide seconds per trace second")
    if args.offline_limit is not None:
        if not args.offline:
            raise InputError(None, "--offline-limit", "needs --offline FILE (the backlog it limits)")
        check_number(args.offline_limit, None, "--offline-limit", integer=True, ge=1, le=INT32_MAX, unit="jobs")
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        if value is not None:
            check_number(value, None, flag, gt=0, unit="ms")
    for flag, value in (("--micro-batch-size", args.micro_batch_size), ("--max-inflight", args.max_inflight),
                        ("--kv-capacity-tokens", args.kv_capacity_tokens)):
        if value is not None:
            check_number(value, None, flag, integer=True, ge=1, le=INT32_MAX)
    if getattr(args, "max_context_tokens", None) is not None:
        check_number(args.max_context_tokens, None, "--max-context-tokens", integer=True, ge=2, le=INT32_MAX,
                     unit="prompt + output tokens")
    if args.timeseries_csv:
        from flexpipe_dag.core.user_files import check_output_file

        check_output_file(args.timeseries_csv, "--timeseries-csv", "a CSV file path")


def model_context(args: argparse.Namespace, gear: Gear) -> tuple[str, int | None]:
    """The model's name and the max context (prompt + output tokens) requests are checked against.

    From ``--model`` when given, else from the gear's ``model_name`` when it is a built-in model;
    ``--max-context-tokens`` sets it (or lowers it: at most the model's own). ``None`` when not known.

    Raises:
        InputError: ``--max-context-tokens`` above the model's max context, naming both.
    """
    from flexpipe_dag.planner.model_spec import builtin_model_names, load_model_spec

    name, known = gear.model_name, None
    if args.model or gear.model_name in builtin_model_names():
        spec = load_model_spec(args.model or gear.model_name)
        name, known = spec.name, spec.max_context_tokens
    wanted = getattr(args, "max_context_tokens", None)
    if wanted is None:
        return name, known
    if known is not None and wanted > known:
        raise InputError(None, "--max-context-tokens", f"{wanted} tokens exceeds {name}'s max context of {known} "
                                                       f"tokens; expected 2..{known}")
    return name, wanted


def build_workload(args: argparse.Namespace) -> Workload:
    """The trace after the windowing, tide shaping, speedup and offline mixing the flags ask for."""
    w = load_trace(args.trace)
    if args.window_s:
        span_s = w.duration_s
        w = time_window(w, args.window_s[0], args.window_s[1])
        if len(w) == 0:
            raise InputError(str(args.trace), "--window-s", f"no request arrives in {args.window_s[0]:g}..{args.window_s[1]:g} s; "
                             f"the trace spans 0..{span_s:.0f} s")
    if args.tide_compression is not None:
        w = shape_by_tide(w, load_tide_trace(), compression=args.tide_compression)
    if getattr(args, "rate_rps", None) is not None:
        own_rps = w.mean_rate_rps
        if own_rps <= 0:
            raise InputError(str(args.trace), "--rate-rps", f"{len(w)} request(s) arriving at one instant have no rate "
                             "to scale; expected a trace (or --window-s) with requests at different times")
        factor = args.rate_rps / own_rps
        if not MIN_SPEEDUP <= factor <= MAX_SPEEDUP:
            raise InputError(str(args.trace), "--rate-rps", f"{args.rate_rps:g} req/s is {factor:.3g}x the trace's own "
                             f"{own_rps:.3g} req/s; expected a rate {MIN_SPEEDUP:g}..{MAX_SPEEDUP:g}x its own "
                             f"({MIN_SPEEDUP * own_rps:.3g}..{MAX_SPEEDUP * own_rps:.3g} req/s)")
        args.speedup = factor
        args.own_rate_rps = own_rps
    if args.speedup is not None and args.speedup != 1.0:
        w = speedup(w, args.speedup)
    if args.offline:
        off = load_trace(args.offline)
        if args.offline_limit is not None:
            off = Workload(off.name, off.requests[: args.offline_limit], off.source, off.meta)
        w = mix(w, as_class(off, "offline", arrival_s=0.0))
    return w


def latency_table(summary: dict[str, Any]) -> IdTable:
    """TTFT / TPOT / e2e mean and percentiles (ms) of a summary as a table that fits any width."""
    table = new_table(None, ["latency", "mean", "P50", "P95", "P99"], text=["latency"])
    for key, label in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("e2e_ms", "e2e ms")):
        d = summary[key]
        table.add_row(label, *(format_number(d[k]) for k in ("mean", "p50", "p95", "p99")))
    return table


def class_table(summary: dict[str, Any]) -> IdTable:
    """Per request class (online / offline): completed of requests, TTFT P99 and goodput."""
    table = new_table(None, ["class", "completed", "requests", "TTFT P99 ms", "goodput req/s"], ids=["class"])
    for klass, c in summary["by_class"].items():
        table.add_row(klass, format_number(c["completed"]), format_number(c["requests"]),
                      format_number(c["ttft_ms"]["p99"]), format_number(c["goodput_rps"], 2))
    return table


def summary_renderables(summary: dict[str, Any]) -> list[RenderableType]:
    """The human report of :func:`flexpipe_dag.sim.results.summarize`'s dict, as lines and tables to print."""
    n = format_number
    gear = f"gear {summary['gear_id']}"
    if summary["final_gear_id"] != summary["gear_id"]:
        gear += f" -> {summary['final_gear_id']}"
    slo, q, kv = summary["slo"], summary["queue_length"], summary["kv_used_fraction"]
    lines = [
        gear,
        f"requests {n(summary['requests'])}: completed {n(summary['completed'])}, rejected {n(summary['rejected'])}"
        + (f" ({n(summary['rejected_context'])} over the max context)" if summary.get("rejected_context") else "")
        + f", unfinished {n(summary['unfinished'])}, preemptions {n(summary['preemptions'])}"
        + (f", truncated to the max context {n(summary['truncated_context'])}" if summary.get("truncated_context") else "")
        + f"; makespan {n(summary['makespan_s'])} s",
    ]
    tail = [
        f"throughput {n(summary['throughput_rps'], 2)} req/s, {n(summary['tokens_per_s'], 0)} output tokens/s",
        f"goodput {n(summary['goodput_rps'], 2)} req/s (TTFT <= {n(slo['ttft_ms'], 0 if float(slo['ttft_ms']).is_integer() else 2)} ms and "
        f"TPOT <= {n(slo['tpot_ms'], 0 if float(slo['tpot_ms']).is_integer() else 2)} ms; "
        f"attainment {n(100 * summary['slo_attainment'])} %"
        + (f"; {n(100 * summary['slo_attainment_after_warmup'])} % after the first quarter of arrivals, as an "
           "envelope is graded" if "slo_attainment_after_warmup" in summary else "") + ")",
    ]
    for gid, util in summary["stage_utilisation"].items():
        tail.append(f"stage utilisation [{gid}]: " + "  ".join(f"s{i} {n(100 * u, 0)}%" for i, u in enumerate(util)))
    tail.append(f"queue length (requests): mean {n(q['mean'])}, P95 {n(q['p95'], 0)}, max {n(q['max'], 0)}")
    tail.append(f"KV use: mean {n(100 * kv['mean'])} %, P95 {n(100 * kv['p95'])} %, max {n(100 * kv['max'])} %")
    out: list[RenderableType] = [Text(line, overflow="fold") for line in lines]
    out.append(latency_table(summary))
    out += [Text(line, overflow="fold") for line in tail]
    if summary["by_class"]:
        out.append(class_table(summary))
    return out


def format_summary(summary: dict[str, Any], width: int = PIPE_WIDTH) -> str:
    """The human-readable report of :func:`flexpipe_dag.sim.results.summarize`'s dict at ``width`` columns."""
    return render_text(*summary_renderables(summary), width=width)


def run(args: argparse.Namespace) -> int:
    if args.day:
        return run_day(args)
    if not args.trace:
        raise InputError(None, "--trace", "give a trace file or bundled name (or --day for the mixed-day simulation)")
    check_flags(args)
    gear, timing = _gear_and_timing(args)
    model_name, max_context = model_context(args, gear)
    workload = build_workload(args)
    basis = gear.envelope_basis  # the SLO the gear's envelope promises, unless the flags say otherwise
    slo_ttft_ms = args.slo_ttft_ms or (basis.slo_ttft_ms if basis else SimConfig.slo_ttft_ms)
    slo_tpot_ms = args.slo_tpot_ms or (basis.slo_tpot_ms if basis else SimConfig.slo_tpot_ms)
    if args.gear_file and basis is None:
        print(f"note: {args.gear_file} has no envelope_basis: its rps_min..rps_max ({gear.rps_min:g}..{gear.rps_max:g} "
              f"req/s) was not measured by `flexpipe plan`; scored at TTFT {slo_ttft_ms:g} ms / TPOT {slo_tpot_ms:g} ms",
              file=sys.stderr)
    budget = chunked_prefill_tokens(args)
    config = SimConfig(slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, micro_batch_size=args.micro_batch_size,
                       max_inflight_micro_batches=args.max_inflight, kv_capacity_tokens=args.kv_capacity_tokens,
                       max_context_tokens=max_context, context_policy="truncate" if args.truncate_context else "refuse",
                       prefill_token_budget=budget, chunked_prefill=budget is not None)
    sim = Simulator(workload, gear, timing, config)
    try:
        result = sim.run()
    except DrainHorizonError as exc:
        if not args.timing:
            raise
        raise InputError(args.timing, exc.field, exc.problem) from exc  # the table the stage times came from
    if args.timeseries_csv:
        result.timeseries().to_csv(args.timeseries_csv, index=False)
    summary = {"trace": str(args.trace), "workload_requests": len(workload), **result.summary,
               "slo_attainment_after_warmup": attainment_after_warmup(result.requests)}
    if getattr(args, "own_rate_rps", None) is not None:
        summary["replay"] = {"rate_rps": args.rate_rps, "speedup": args.speedup, "trace_rate_rps": args.own_rate_rps}
    summary["context"] = {"model": model_name, **(summary.get("context") or {})}
    context_line = sim.context.describe(model_name, "--truncate-context serves them truncated")
    if max_context is None:
        context_line += " (give --model or --max-context-tokens to check them)"
    if args.json:
        if max_context is None or sim.context.over_context:
            print(context_line, file=sys.stderr)  # never silent, even when stdout is JSON
        print(json.dumps(summary, indent=2))
    else:
        console = cli_console()
        replay = summary.get("replay")
        console.print(Text(f"trace {args.trace}: {format_number(len(workload))} requests over "
                           f"{format_number(workload.duration_s, 0)} s"
                           + (f", replayed at {format_number(replay['rate_rps'], 3)} req/s (its own "
                              f"{format_number(replay['trace_rate_rps'], 3)} req/s x {replay['speedup']:.4g})"
                              if replay else ""), overflow="fold"))
        console.print(Text(context_line, overflow="fold"))
        for item in summary_renderables(summary):
            console.print(item)
    return 0
