"""``flexpipe simulate``: replay a request trace through a gear and print what users would see.

Two ways to name the gear and its stage times:

* ``--cluster FILE --model MODEL --gear GEAR_ID|KIND``: the planner proposes gears for the cluster
  and model; the one with that id (or the first of that kind) is simulated with the planner's cost
  model (``CostModel.timings(gear)``).
* ``--gear-file GEAR.json|yaml --timing STAGES.csv``: a gear written by hand or exported by
  ``flexpipe plan``, with measured per-stage linear costs (see ``flexpipe_dag.sim.timing``).

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
import math
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import OPERATING_KINDS, Gear
from flexpipe_dag.core.settings import INT32_MAX, check_number
from flexpipe_dag.core.timing import StageTimingModel
from flexpipe_dag.core.user_yaml import load_user_yaml
from flexpipe_dag.sim import LinearStageTiming, SimConfig, Simulator
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


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("simulate", help="replay a request trace through a gear (TTFT, TPOT, goodput, utilisation)",
                              description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", help="cluster profile YAML (with --model and --gear)")
    p.add_argument("--model", help="model name or config path (with --cluster; with --gear-file: only its max context)")
    p.add_argument("--gear", help="gear id or kind (latency / balanced / throughput) among the planner's gears")
    p.add_argument("--dtype", default="bf16", help="weight dtype for the planner (default bf16)")
    p.add_argument("--gear-file", help="a Gear as JSON or YAML (instead of --cluster/--model/--gear)")
    p.add_argument("--timing", help="per-stage linear costs CSV (with --gear-file)")
    bundled = ", ".join(n for n in BUNDLED_TRACES if n != "servegen-tide")
    p.add_argument("--trace", required=True, help=f"trace file or bundled name ({bundled})")
    p.add_argument("--speedup", type=float, default=1.0, help="compress arrival times by this factor (default 1)")
    p.add_argument("--window-s", type=float, nargs=2, metavar=("START", "END"), help="only requests arriving in [START, END) s")
    p.add_argument("--tide-compression", type=float,
                   help="shape the trace by the bundled ServeGen daily tide, this many tide seconds per trace second")
    p.add_argument("--offline", help="also queue this length-only / request file as an offline backlog at 0 s")
    p.add_argument("--offline-limit", type=int, help="use only the first N offline jobs")
    p.add_argument("--slo-ttft-ms", type=float, default=SimConfig.slo_ttft_ms)
    p.add_argument("--slo-tpot-ms", type=float, default=SimConfig.slo_tpot_ms)
    p.add_argument("--micro-batch-size", type=int, help="override the gear's sequences per micro-batch")
    p.add_argument("--max-inflight", type=int, help="override the gear's max in-flight micro-batches")
    p.add_argument("--kv-capacity-tokens", type=int, help="override the gear's KV pool size")
    p.add_argument("--max-context-tokens", type=int,
                   help="max context (prompt + output tokens) requests must fit; default the model's own, at most it")
    p.add_argument("--truncate-context", action="store_true",
                   help="serve requests over the max context with the prompt cut from the left (default: reject them)")
    p.add_argument("--timeseries-csv", help="write the 2 s metric samples (queue, KV use, stage busy) to this CSV")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def load_gear_file(path: str | Path) -> Gear:
    """Read a :class:`Gear` from JSON or YAML.

    Raises:
        InputError: missing file, unparsable, or a field that fails validation (named by path).
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(str(path), None, "file not found; expected a gear as JSON or YAML")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix.lower() == ".json" else load_user_yaml(text, str(path))
    except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise InputError(str(path), None, f"cannot parse: {exc}") from exc
    if isinstance(data, dict) and data.get("rps_max", 0) is None:
        data = {k: v for k, v in data.items() if k != "rps_max"}  # Gear.model_dump_json writes an unbounded envelope as null
    try:
        return Gear.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InputError(str(path), ".".join(str(x) for x in err["loc"]) or None, err["msg"]) from exc


def _planner_gear(args: argparse.Namespace) -> tuple[Gear, StageTimingModel]:
    """Plan gears for the cluster and model and pick ``--gear`` by id or kind."""
    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.planner.cost_model import CostModel
    from flexpipe_dag.planner.gears import plan_gears
    from flexpipe_dag.planner.model_spec import load_model_spec

    cluster = load_cluster_profile(args.cluster)
    model = load_model_spec(args.model)
    gears = list(plan_gears(cluster, model, dtype=args.dtype))
    chosen = next((g for g in gears if g.gear_id == args.gear), None) or next((g for g in gears if g.kind == args.gear), None)
    if chosen is None:
        raise InputError(None, "--gear", f"got {args.gear!r}; expected a kind {list(OPERATING_KINDS)} or one of "
                         f"{[g.gear_id for g in gears]}")
    cost_model = CostModel(model, cluster, dtype=args.dtype)
    return chosen, cost_model.timings(chosen)


def _gear_and_timing(args: argparse.Namespace) -> tuple[Gear, StageTimingModel]:
    if args.gear_file:
        if not args.timing:
            raise InputError(None, "--timing", "--gear-file needs --timing STAGES.csv (per-stage linear costs)")
        return load_gear_file(args.gear_file), LinearStageTiming.from_csv(args.timing)
    missing = [f"--{n}" for n in ("cluster", "model", "gear") if not getattr(args, n)]
    if missing:
        raise InputError(None, missing[0], "give --cluster, --model and --gear, or --gear-file and --timing")
    return _planner_gear(args)


def check_flags(args: argparse.Namespace) -> None:
    """Refuse bad numeric flags before any file is read or anything is simulated.

    Raises:
        InputError: naming the flag and what was expected (``--speedup`` > 0, ``--window-s`` START >= 0
            and END > START, ``--tide-compression`` > 0, ``--offline-limit`` >= 1 and only with
            ``--offline``, SLOs > 0, micro-batch / in-flight / KV overrides >= 1, a writable
            ``--timeseries-csv`` path, a known ``--dtype``).
    """
    from flexpipe_dag.core.dtypes import canonical_dtype

    args.dtype = canonical_dtype(args.dtype, None, "--dtype")
    check_number(args.speedup, None, "--speedup", gt=0, unit="factor")
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
    check_number(args.slo_ttft_ms, None, "--slo-ttft-ms", gt=0, unit="ms")
    check_number(args.slo_tpot_ms, None, "--slo-tpot-ms", gt=0, unit="ms")
    for flag, value in (("--micro-batch-size", args.micro_batch_size), ("--max-inflight", args.max_inflight),
                        ("--kv-capacity-tokens", args.kv_capacity_tokens)):
        if value is not None:
            check_number(value, None, flag, integer=True, ge=1, le=INT32_MAX)
    if getattr(args, "max_context_tokens", None) is not None:
        check_number(args.max_context_tokens, None, "--max-context-tokens", integer=True, ge=2, le=INT32_MAX,
                     unit="prompt + output tokens")
    if args.timeseries_csv:
        out = Path(args.timeseries_csv)
        if out.is_dir():
            raise InputError(None, "--timeseries-csv", f"{out} is a directory; expected a CSV file path")
        if not out.parent.is_dir():
            raise InputError(None, "--timeseries-csv", f"directory {out.parent} does not exist")


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
        w = time_window(w, args.window_s[0], args.window_s[1])
    if args.tide_compression is not None:
        w = shape_by_tide(w, load_tide_trace(), compression=args.tide_compression)
    if args.speedup != 1.0:
        w = speedup(w, args.speedup)
    if args.offline:
        off = load_trace(args.offline)
        if args.offline_limit is not None:
            off = Workload(off.name, off.requests[: args.offline_limit], off.source, off.meta)
        w = mix(w, as_class(off, "offline", arrival_s=0.0))
    return w


def _fmt(v: Any, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.1f}{unit}"


def format_summary(summary: dict[str, Any]) -> str:
    """The human-readable report of :func:`flexpipe_dag.sim.results.summarize`'s dict."""
    lines = [
        f"gear {summary['gear_id']}" + (f" -> {summary['final_gear_id']}" if summary["final_gear_id"] != summary["gear_id"] else ""),
        f"requests {summary['requests']}: completed {summary['completed']}, rejected {summary['rejected']}"
        + (f" ({summary['rejected_context']} over the max context)" if summary.get("rejected_context") else "")
        + f", unfinished {summary['unfinished']}, preemptions {summary['preemptions']}"
        + (f", truncated to the max context {summary['truncated_context']}" if summary.get("truncated_context") else "")
        + f"; makespan {summary['makespan_s']:.1f} s",
        f"{'':8}{'mean':>12}{'P50':>12}{'P95':>12}{'P99':>12}",
    ]
    for key, label in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("e2e_ms", "e2e ms")):
        d = summary[key]
        lines.append(f"{label:8}" + "".join(f"{_fmt(d[k]):>12}" for k in ("mean", "p50", "p95", "p99")))
    slo = summary["slo"]
    lines += [
        f"throughput {summary['throughput_rps']:.2f} req/s, {summary['tokens_per_s']:,.0f} output tokens/s",
        f"goodput {summary['goodput_rps']:.2f} req/s (TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms; "
        f"attainment {100 * summary['slo_attainment']:.1f} %)",
    ]
    for gid, util in summary["stage_utilisation"].items():
        lines.append(f"stage utilisation [{gid}]: " + "  ".join(f"s{i} {100 * u:.0f}%" for i, u in enumerate(util)))
    q, kv = summary["queue_length"], summary["kv_used_fraction"]
    lines.append(f"queue length (requests): mean {q['mean']:.1f}, P95 {q['p95']:.0f}, max {q['max']:.0f}")
    lines.append(f"KV use: mean {100 * kv['mean']:.1f} %, P95 {100 * kv['p95']:.1f} %, max {100 * kv['max']:.1f} %")
    for klass, c in summary["by_class"].items():
        lines.append(f"{klass}: {c['completed']}/{c['requests']} done, TTFT P99 {_fmt(c['ttft_ms']['p99'])} ms, "
                     f"goodput {c['goodput_rps']:.2f} req/s")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    check_flags(args)
    gear, timing = _gear_and_timing(args)
    model_name, max_context = model_context(args, gear)
    workload = build_workload(args)
    config = SimConfig(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, micro_batch_size=args.micro_batch_size,
                       max_inflight_micro_batches=args.max_inflight, kv_capacity_tokens=args.kv_capacity_tokens,
                       max_context_tokens=max_context, context_policy="truncate" if args.truncate_context else "refuse")
    sim = Simulator(workload, gear, timing, config)
    result = sim.run()
    if args.timeseries_csv:
        result.timeseries().to_csv(args.timeseries_csv, index=False)
    summary = {"trace": str(args.trace), "workload_requests": len(workload), **result.summary}
    summary["context"] = {"model": model_name, **(summary.get("context") or {})}
    context_line = sim.context.describe(model_name, "--truncate-context serves them truncated")
    if max_context is None:
        context_line += " (give --model or --max-context-tokens to check them)"
    if args.json:
        if max_context is None or sim.context.over_context:
            print(context_line, file=sys.stderr)  # never silent, even when stdout is JSON
        print(json.dumps(summary, indent=2))
    else:
        print(f"trace {args.trace}: {len(workload)} requests over {workload.duration_s:.0f} s")
        print(context_line)
        print(format_summary(result.summary))
    return 0
