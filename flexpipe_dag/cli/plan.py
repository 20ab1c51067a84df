"""``flexpipe plan``: print the latency / balanced / throughput gears for a model on a cluster."""

from __future__ import annotations

import argparse
import json

from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.core.dtypes import DTYPE_NAMES, canonical_dtype
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.settings import INT32_MAX, check_number, env_value

#: ``--context-p95`` when not given (capped at the model's own max context).
DEFAULT_CONTEXT_P95_TOKENS = 4096


def _dtype(name: str) -> str:
    """argparse type: a dtype name or alias -> its canonical name."""
    try:
        return canonical_dtype(name, None, "--dtype")
    except InputError as exc:
        raise argparse.ArgumentTypeError(exc.problem) from None


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="plan candidate gears for a model on a cluster",
                              description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--cluster", required=True, help="cluster profile file (.yaml / .json; native, seed or fleet form)")
    p.add_argument("--model", required=True,
                   help="built-in model name, a Hugging Face config.json directory, or a .gguf file")
    p.add_argument("--dtype", default="bf16", type=_dtype, metavar="{" + ",".join(DTYPE_NAMES) + "}",
                   help="weight dtype (float32 / bfloat16 / float16 also read)")
    p.add_argument("--context-p95", type=int, default=None,
                   help=f"P95 context tokens (prompt + output) the KV pool is sized for; at most the model's max "
                        f"context (default {DEFAULT_CONTEXT_P95_TOKENS}, or the model's max context if smaller)")
    p.add_argument("--concurrency", type=int, default=64, help="sequences in flight the KV pool must hold")
    p.add_argument("--min-residence-s", type=float, default=600.0,
                   help="devices whose available_until is sooner are not used")
    p.add_argument("--no-replicas", action="store_true",
                   help="no stage replicas (one device per stage); also FLEXPIPE_STAGE_REPLICAS=0")
    p.add_argument("--json", action="store_true", help="print the gears as JSON")
    p.set_defaults(func=run)


def context_p95_tokens(requested: int | None, model) -> int:
    """The P95 context to plan for: ``requested`` (``--context-p95``) checked against the model's max context.

    Without ``requested``: :data:`DEFAULT_CONTEXT_P95_TOKENS`, or the model's max context when smaller.

    Raises:
        InputError: ``--context-p95`` is not an integer >= 1, or exceeds the model's max context
            (``max_position_embeddings`` / GGUF ``context_length``), naming both.
    """
    max_ctx = model.max_context_tokens
    if requested is None:
        return min(DEFAULT_CONTEXT_P95_TOKENS, max_ctx) if max_ctx else DEFAULT_CONTEXT_P95_TOKENS
    check_number(requested, None, "--context-p95", integer=True, ge=1, le=INT32_MAX, unit="tokens")
    if max_ctx and requested > max_ctx:
        raise InputError(None, "--context-p95", f"{requested} tokens exceeds {model.name}'s max context of {max_ctx} "
                         f"tokens ({model.source}); expected 1..{max_ctx}")
    return requested


def check_flags(args: argparse.Namespace) -> None:
    """Refuse a bad ``--concurrency`` or ``--min-residence-s`` before any file is read.

    Raises:
        InputError: naming the flag and the expected range.
    """
    check_number(args.concurrency, None, "--concurrency", integer=True, ge=1, le=INT32_MAX, unit="sequences")
    check_number(args.min_residence_s, None, "--min-residence-s", ge=0, unit="seconds")
    if args.context_p95 is not None:
        check_number(args.context_p95, None, "--context-p95", integer=True, ge=1, le=INT32_MAX, unit="tokens")


def run(args: argparse.Namespace) -> int:
    from flexpipe_dag.planner.gears import plan_gears
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.planner.workload import PlanWorkload

    check_flags(args)
    replicas_allowed = env_value("FLEXPIPE_STAGE_REPLICAS", bool, True)
    replicas = bool(replicas_allowed) and not args.no_replicas
    cluster = load_cluster_profile(args.cluster)
    model = load_model_spec(args.model)
    workload = PlanWorkload(context_p95_tokens=context_p95_tokens(args.context_p95, model),
                            concurrency=args.concurrency, min_residence_s=args.min_residence_s)
    gears = plan_gears(cluster, model, dtype=args.dtype, workload=workload, replicas=replicas)
    if args.json:
        print(json.dumps({"cluster_id": cluster.cluster_id, "model": model.summary(args.dtype),
                          "gears": [g.model_dump(mode="json") for g in gears]}, indent=2))
        return 0
    _print_table(cluster.cluster_id, model.name, args.dtype, gears)
    return 0


def _print_table(cluster_id: str, model_name: str, dtype: str, gears, console=None) -> None:
    from flexpipe_dag.cli.tables import cli_console, format_number, format_pair, format_range, new_table

    console = console or cli_console()
    summary = new_table(f"gears for {model_name} ({dtype}) on {cluster_id}",
                        ["gear", "stages", "micro-batch", "in-flight", "tokens/s", "req/s", "TTFT p50/p99 ms",
                         "TPOT p50/p99 ms", "rps envelope", "KV tokens"], ids=["gear"])
    for g in gears:
        e = g.estimate
        summary.add_row(g.gear_id, str(g.num_stages), str(g.micro_batch_size), str(g.max_inflight_micro_batches),
                        format_number(e.tokens_per_s, 0), format_number(e.throughput_rps, 2),
                        format_pair(e.ttft_p50_ms, e.ttft_p99_ms, 0), format_pair(e.tpot_p50_ms, e.tpot_p99_ms, 1),
                        format_range(g.rps_min, g.rps_max, 2), format_number(g.kv_capacity_tokens))
    console.print(summary)
    for g in gears:
        t = new_table(f"{g.gear_id} stages", ["stage", "layers", "devices", "est ms/step", "weights GiB", "KV tokens"],
                      text=["layers", "devices"])
        for s in g.stages:
            t.add_row(str(s.stage_index), f"{s.layer_start}-{s.layer_end - 1} ({s.num_layers})", ", ".join(s.device_ids),
                      format_number(s.est_stage_ms, 2), format_number(s.weight_gib, 2),
                      format_number(s.kv_capacity_tokens))
        console.print(t)
