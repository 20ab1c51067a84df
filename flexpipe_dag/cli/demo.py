"""``flexpipe demo``: the main job, run as Dagster runs on this host's instance (``DAGSTER_HOME``).

1. ``profile_refresh``: measure this host (CPU worker processes stand in for devices without GPUs);
2. ``plan_gears``: SmolLM2-135M's profile, candidate gears for this host, envelopes measured in the
   simulator on the real Azure conv trace (lengths capped for the CPU);
3. ``serve_trace``: a tide-shaped, time-compressed slice of the Azure conv trace through the real
   multi-process pipeline; the gear-shift controller moves it as the load changes and an offline
   batch job fills the trough; a summary and an HTML report under ``FLEXPIPE_HOME/reports``.

Before that it loads the bundled fragmented fleet (A100 + V100 + T4 + A10) and prints the gears the
planner proposes for Llama-3-8B there. Runs are recorded in the Dagster instance, so ``make dev``
shows them afterwards. The demo compresses time: a tide day plays in ``--duration-s`` seconds and
the controller's dwell is shortened accordingly (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from flexpipe_dag.core.errors import InputError

FLEET_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "fragmented_lab.yaml"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job end to end as Dagster runs", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=240.0, help="wall seconds one tide day is compressed into")
    p.add_argument("--dwell-s", type=float, default=30.0, help="controller dwell after a shift (seed: 600 s)")
    p.add_argument("--mean-rps", type=float, default=0.0, help="mean online rate (0: 60%% of the first gear's envelope)")
    p.add_argument("--fleet", default=str(FLEET_EXAMPLE), help="fragmented fleet to plan Llama-3-8B for (preview)")
    p.add_argument("--ui", action="store_true", help="instead: start the Dagster UI (dagster dev) with the demo's settings")
    p.set_defaults(func=run)


#: The demo's CPU-sized service (environment read by the code location): SmolLM2 in fp32 on CPU
#: workers, lengths capped, an SLO a CPU can meet, the dwell shortened for a compressed day.
DEMO_ENV = {"FLEXPIPE_MODEL": "SmolLM2-135M", "FLEXPIPE_PLAN_DTYPE": "fp32", "FLEXPIPE_MAX_PROMPT_TOKENS": "96",
            "FLEXPIPE_MAX_NEW_TOKENS": "12", "FLEXPIPE_PLAN_CONCURRENCY": "16", "FLEXPIPE_REFERENCE_REQUESTS": "600",
            "FLEXPIPE_SLO_TTFT_MS": "4000", "FLEXPIPE_SLO_TPOT_MS": "600", "FLEXPIPE_PROBE": "1",
            "FLEXPIPE_STAGE_REPLICAS": "0"}


def fleet_preview(path: str) -> None:
    """Print the gears the planner proposes for Llama-3-8B on a fragmented fleet (nothing stored)."""
    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.planner.gears import plan_gears
    from flexpipe_dag.planner.model_spec import load_model_spec

    cluster = load_cluster_profile(path)
    kinds = ", ".join(f"{d.model_name}" for d in cluster.devices)
    print(f"== fleet preview: {cluster.cluster_id} ({len(cluster.devices)} GPUs: {kinds})")
    for g in plan_gears(cluster, load_model_spec("Llama-3-8B"), concurrency=32, context_p95_tokens=2048):
        stages = "; ".join(f"L{st.layer_start}-{st.layer_end - 1}@{'+'.join(st.device_ids)}" for st in g.stages)
        print(f"   {g.gear_id:24s} {stages}  micro-batch {g.micro_batch_size}, "
              f"~{g.estimate.tokens_per_s:.0f} tok/s" if g.estimate else "")


def run(args: argparse.Namespace) -> int:
    import warnings

    from dagster import BetaWarning, DagsterInstance, PreviewWarning, execute_job, reconstructable

    from flexpipe_dag import demo_defs

    if args.duration_s < 30:
        raise InputError(None, "--duration-s", f"expected >= 30, got {args.duration_s}")
    warnings.filterwarnings("ignore", category=BetaWarning)
    warnings.filterwarnings("ignore", category=PreviewWarning)
    for var, value in {**DEMO_ENV, "FLEXPIPE_DWELL_S": str(args.dwell_s)}.items():
        os.environ.setdefault(var, value)
    if args.ui:
        repo = Path(__file__).resolve().parents[2]
        dagster = str(Path(sys.executable).with_name("dagster"))
        os.execv(dagster, [dagster, "dev", "-w", str(repo / "workspace.yaml"), "-h", "127.0.0.1", "-p", "3000"])
    fleet_preview(args.fleet)
    print("== settings: " + ", ".join(f"{k}={os.environ[k]}" for k in (*DEMO_ENV, "FLEXPIPE_DWELL_S")), flush=True)
    instance = DagsterInstance.get() if os.environ.get("DAGSTER_HOME") else DagsterInstance.ephemeral()
    run_configs = {
        "profile_refresh": {},
        "plan_gears": {},
        "serve_trace": {"ops": {"serve": {"config": {"duration_s": args.duration_s, "mean_rps": args.mean_rps}}}},
    }
    summary = None
    for job_name, factory in demo_defs.DEMO_JOBS.items():
        print(f"== dagster run: {job_name}", flush=True)
        result = execute_job(reconstructable(factory), instance=instance, run_config=run_configs[job_name])
        if not result.success:
            print(f"flexpipe demo: run {result.run_id} of {job_name} failed; see `make dev` -> Runs", file=sys.stderr)
            return 1
        print(f"   run {result.run_id}: success", flush=True)
        if job_name == "serve_trace":
            summary = result.output_for_node("serve")["summary"]
            report = result.output_for_node("serve")["report"]
    print_summary(summary, report)
    return 0 if summary and summary["lost"] == 0 and summary["shifts"] else 1


def print_summary(summary: dict, report: str) -> None:
    print("== summary")
    print(f"   requests served {summary['served']} of {summary['submitted']}, lost {summary['lost']}, "
          f"duplicated {summary['duplicates']}; {summary['output_tokens_per_s']} output tokens/s over "
          f"{summary['elapsed_s']} s")
    for klass, v in summary["by_class"].items():
        print(f"   {klass:8s} n={v['served']:4d}  TTFT p50/p99 {v['ttft_p50_ms']}/{v['ttft_p99_ms']} ms  "
              f"TPOT p50/p99 {v['tpot_p50_ms']}/{v['tpot_p99_ms']} ms")
    for sh in summary["shifts"]:
        print(f"   shift at {sh['t_s']:.0f} s: {sh['from_gear']} -> {sh['to_gear']} [{sh['status']}, "
              f"{sh.get('timings_s', {}).get('total', 0):.0f} s]: {sh['reason']}")
    for d in summary.get("offline_admissions", []):
        print(f"   offline at {d['t_s']:.0f} s: {d['reason']}")
    print(f"   report: {report}")
    print(json.dumps({k: summary[k] for k in ("served", "lost", "output_tokens_per_s")}))
