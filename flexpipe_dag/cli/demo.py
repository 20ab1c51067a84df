"""``flexpipe demo``: the main job, run as Dagster runs on this host's instance (``DAGSTER_HOME``).

1. ``profile_refresh``: measure this host (CPU worker processes stand in for devices without GPUs);
2. ``plan_gears``: SmolLM2-135M's profile, candidate gears for this host, envelopes measured in the
   simulator on the real Azure conv trace (lengths capped for the CPU);
3. ``batch_inference``: a short batch of real-trace prompts through the deepest gear; every stage
   step is measured;
4. ``plan_gears`` again: the ``calibration`` asset fits the cost model to those measurements, and
   gears and envelopes are re-planned with it (closed loop);
5. ``serve_frontdoor``: ``flexpipe serve`` (the OpenAI-compatible front door) on the planned latency
   gear; a tide-shaped, time-compressed slice of the Azure conv trace sent to it as real streaming HTTP
   requests by the load tester, and an offline job submitted through its Batch API, which fills the
   trough; the gear-shift controller moves the live pipeline as the load changes; a summary (lost and
   failed requests as the clients saw them) and an HTML report under ``FLEXPIPE_HOME/reports``.

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
from importlib import resources
from pathlib import Path

from flexpipe_dag.core.errors import InputError

#: Declined-shift episodes the summary prints (the HTML report lists them all).
DECLINES_SHOWN = 6
FLEET_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "fragmented_lab.yaml"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job end to end as Dagster runs", description=__doc__.replace("``", ""),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=200.0, help="wall seconds one tide day is compressed into")
    p.add_argument("--dwell-s", type=float, default=30.0, help="controller dwell after a shift (seed: 600 s)")
    p.add_argument("--mean-rps", type=float, default=0.0, help="mean online rate (0: the first gear's envelope rps_max)")
    p.add_argument("--fleet", default=str(FLEET_EXAMPLE), help="fragmented fleet to plan Llama-3-8B for (preview)")
    p.add_argument("--ui", action="store_true", help="instead: start the Dagster UI (dagster dev) with the demo's settings")
    p.set_defaults(func=run)


#: The demo's CPU-sized service (environment read by the code location): SmolLM2 in fp32 on CPU
#: workers, lengths capped, an SLO a CPU can meet, the dwell shortened for a compressed day.
DEMO_ENV = {"FLEXPIPE_MODEL": "SmolLM2-135M", "FLEXPIPE_PLAN_DTYPE": "fp32", "FLEXPIPE_MAX_PROMPT_TOKENS": "96",
            "FLEXPIPE_MAX_NEW_TOKENS": "12", "FLEXPIPE_PLAN_CONCURRENCY": "16", "FLEXPIPE_REFERENCE_REQUESTS": "1000",
            "FLEXPIPE_SLO_TTFT_MS": "4000", "FLEXPIPE_SLO_TPOT_MS": "600", "FLEXPIPE_PROBE": "1",
            "FLEXPIPE_STAGE_REPLICAS": "0"}


def fleet_preview(path: str) -> None:
    """Print the gears ``flexpipe plan`` proposes for Llama-3-8B on a fragmented fleet, with the envelopes
    the simulator measured for them at the default SLO (nothing stored)."""
    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.resources.planning import PlanningSettings

    cluster = load_cluster_profile(path)
    kinds = ", ".join(f"{d.model_name}" for d in cluster.devices)
    print(f"== fleet preview: {cluster.cluster_id} ({len(cluster.devices)} GPUs: {kinds})")
    plan = PlanningSettings(model="Llama-3-8B").plan(cluster, load_model_spec("Llama-3-8B"))
    print(f"   envelopes: {plan.basis.describe()} ({plan.probes} simulations, {plan.wall_s:.0f} s)")
    for g in plan.gears:
        stages = "; ".join(f"L{st.layer_start}-{st.layer_end - 1}@{'+'.join(st.device_ids)}" for st in g.stages)
        print(f"   {g.gear_id:24s} {stages}  micro-batch {g.micro_batch_size}, {g.dtype}, "
              f"envelope {g.rps_min:.2f}..{g.rps_max:.2f} req/s")
    for note in plan.notes:
        print(f"   note: {note}")


def dagster_home() -> Path:
    """``DAGSTER_HOME``, defaulting (as ``make`` does) to ``$FLEXPIPE_HOME/dagster`` with the repo's
    ``deploy/dagster.yaml``: the jobs run in subprocesses, which an ephemeral instance cannot coordinate."""
    from flexpipe_dag.core.settings import flexpipe_home

    home = Path(os.environ.get("DAGSTER_HOME") or flexpipe_home() / "dagster").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    settings = home / "dagster.yaml"
    if not settings.exists():
        shipped = resources.files("flexpipe_dag.data") / "dagster.yaml"  # deploy/dagster.yaml, installed
        settings.write_bytes(shipped.read_bytes())
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def run(args: argparse.Namespace) -> int:
    import warnings

    from dagster import BetaWarning, DagsterInstance, PreviewWarning, execute_job, reconstructable

    from flexpipe_dag import demo_defs
    from flexpipe_dag.jobs.pools import initialise_pools

    if args.duration_s < 30:
        raise InputError(None, "--duration-s", f"expected >= 30, got {args.duration_s}")
    warnings.filterwarnings("ignore", category=BetaWarning)
    warnings.filterwarnings("ignore", category=PreviewWarning)
    for var, value in {**DEMO_ENV, "FLEXPIPE_DWELL_S": str(args.dwell_s)}.items():
        os.environ.setdefault(var, value)
    dagster_home()
    if args.ui:
        dagster = str(Path(sys.executable).with_name("dagster"))
        os.execv(dagster, [dagster, "dev", "-m", "flexpipe_dag.definitions", "-h", "127.0.0.1", "-p", "3000"])
    fleet_preview(args.fleet)
    print("== settings: " + ", ".join(f"{k}={os.environ[k]}" for k in (*DEMO_ENV, "FLEXPIPE_DWELL_S")), flush=True)
    instance = DagsterInstance.get()
    initialise_pools(instance)  # before two runs can race to create a pool's slots

    def launch(job_name: str, run_config: dict, output_of: str | None = None):
        print(f"== dagster run: {job_name}", flush=True)
        run_config = {**run_config, "loggers": {"console": {"config": {"log_level": "INFO"}}}}  # no DEBUG events
        with execute_job(reconstructable(demo_defs.DEMO_JOBS[job_name]), instance=instance,
                         run_config=run_config) as result:
            if not result.success:
                print(f"flexpipe demo: run {result.run_id} of {job_name} failed; see `make dev` -> Runs",
                      file=sys.stderr)
                raise SystemExit(1)
            print(f"   run {result.run_id}: success", flush=True)
            return result.output_for_node(output_of) if output_of else None

    launch("profile_refresh", {})
    launch("plan_gears", {})
    launch("batch_inference", {"ops": {"run_batch": {"config": {
        "job_key": f"calibration-{os.getpid()}", "trace": "azure-conv", "num_requests": 16, "max_prompt_tokens": 96,
        "max_new_tokens": 12, "gear_id": deepest_gear_id()}}}})
    launch("plan_gears", {})
    for line in calibration_lines():
        print(f"   calibration: {line}")
    out = launch("serve_frontdoor", {"ops": {"serve_http": {"config": {
        "duration_s": args.duration_s, "mean_rps": args.mean_rps, "operator_drill_at": OPERATOR_DRILL_AT}}}},
        output_of="serve_http")
    summary = out["summary"]
    print_summary(summary, out["report"])
    if summary.get("gears", 2) < 2:
        print("   note: the plan for this host has one gear, so there was nothing to shift to (the live shift is "
              "checked by tests/test_frontdoor.py)")
    shifted = bool(summary["shifts"]) or summary.get("gears", 2) < 2
    return 0 if summary["lost"] == 0 and summary.get("failed", 0) == 0 and shifted else 1


#: Share of the replay after which the demo asks for a shift by hand when the controller has made none:
#: on a 2-core host the planned gears often hold nearly the same rate, and the controller rightly finds
#: no shift that pays; the demo still shows a live shift under HTTP traffic, as an operator would make it.
OPERATOR_DRILL_AT = 0.55


def _store():
    from flexpipe_dag.sql.store import Store

    return Store.from_url()


def deepest_gear_id() -> str:
    """The stored gear with the most stages (its run measures the most devices for calibration)."""
    db = _store()
    gears = [g for g in db.load_gears(db.latest_profile()[0].id) if all(st.replicas == 1 for st in g.stages)]
    return max(gears, key=lambda g: (g.num_stages, g.micro_batch_size)).gear_id


def calibration_lines() -> list[str]:
    db = _store()
    rows = db.calibrations(db.latest_profile()[0].id)
    return list(rows[-1].summary) if rows else ["no calibration: the profile's values are used"]


def print_summary(summary: dict, report: str) -> None:
    print("== summary")
    failed = f", failed {summary['failed']}" if "failed" in summary else ""
    print(f"   requests served {summary['served']} of {summary['submitted']}, lost {summary['lost']}{failed}, "
          f"duplicated {summary['duplicates']}; {summary['output_tokens_per_s']} output tokens/s over "
          f"{summary['elapsed_s']} s")
    if summary.get("batch"):
        b = summary["batch"]
        print(f"   batch {b['id']} (Batch API): {b['status']}, {b['request_counts']}")
    for klass, v in summary["by_class"].items():
        if v["ttft_p50_ms"] is None:  # Batch API lines: the client sees the output file, not the tokens' times
            print(f"   {klass:8s} n={v['served']:4d}  (latencies not seen by the client: in /metrics)")
            continue
        print(f"   {klass:8s} n={v['served']:4d}  TTFT p50/p99 {v['ttft_p50_ms']}/{v['ttft_p99_ms']} ms  "
              f"TPOT p50/p99 {v['tpot_p50_ms']}/{v['tpot_p99_ms']} ms")
    for sh in summary["shifts"]:
        print(f"   shift at {sh['t_s']:.0f} s: {sh['from_gear']} -> {sh['to_gear']} [{sh['status']}, "
              f"{sh.get('timings_s', {}).get('total', 0):.0f} s]: {sh['reason']}")
    episodes = summary.get("declines", [])
    for d in episodes[:DECLINES_SHOWN]:
        print(f"   declined {d['count']}x at {d['first_t_s']:.0f}..{d['last_t_s']:.0f} s [{d['kind']}; "
              f"{d['triggers']}]: {d['reason']}")
    if len(episodes) > DECLINES_SHOWN:
        rest = episodes[DECLINES_SHOWN:]
        print(f"   ... {len(rest)} more declined episode(s), {sum(d['count'] for d in rest)} declines, "
              f"{rest[0]['first_t_s']:.0f}..{rest[-1]['last_t_s']:.0f} s: listed in the report")
    for d in summary.get("offline_admissions", []):
        print(f"   offline at {d['t_s']:.0f} s: {d['reason']}")
    print(f"   report: {report}")
    print(json.dumps({k: summary[k] for k in ("served", "lost", "failed", "output_tokens_per_s") if k in summary}))
