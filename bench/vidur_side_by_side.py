"""FlexPipe's simulator beside Vidur (microsoft/vidur, MLSys'24) on one homogeneous configuration.

Usage: python bench/vidur_side_by_side.py [--vidur-python /tmp/vidur-venv/bin/python] [--requests 1000]
       [--rates 2,4,8] [--gpu h100|a100] [--batch-cap 128] [--workdir /tmp/flexpipe-vidur]

Workload: the bundled Azure LLM inference trace 2023, conversation (``load_trace("azure-conv")``), its
first ``--requests`` requests, time-compressed (``speedup``) to each mean rate in ``--rates``. The same
requests (arrival, prompt tokens, output tokens) are written to the CSV Vidur's ``trace_replay``
request generator reads (columns Date, Time, PromptTokenCount, CompletionTokenCount; scale factors 1).

Configuration both support: Llama-3-8B, bf16, one GPU (one pipeline stage, no tensor parallelism), one
replica, at most ``--batch-cap`` sequences per batch, prompts + outputs up to 8,192 tokens.
``--gpu h100`` (default) is the device whose profile datasets Vidur 0.0.26 names by default
(``project-vajra/dev-staging-meta-llama-llama-3-8b-h100`` and ``project-vajra/dev-staging-h100-dgx``);
``--gpu a100`` needs ``--vidur-compute-dataset`` / ``--vidur-network-dataset`` (no default is known).

Per rate it prints each simulator's wall time, TTFT p50/p99, TPOT p50/p99, e2e p50, throughput and the
ratios FlexPipe / Vidur. Vidur runs in its own interpreter (``--vidur-python``; it pulls wandb,
streamlit, ...: keep it out of FlexPipe's environment). Without ``--vidur-python`` only FlexPipe's side
is printed; when Vidur cannot run, the script says so with Vidur's own error and prints no Vidur figure.

What differs between the two setups (beyond the shared workload and limits):

* execution times: Vidur predicts each batch from operator profiles measured on real GPUs (random
  forests over attention / MLP / collective timings); FlexPipe's planner cost model is a roofline from
  datasheet figures (``flexpipe_dag/data/gpu_specs.yaml``) with its calibration factors;
* scheduling: Vidur's ``vllm`` replica scheduler (continuous batching, prefill-prioritised batches of at
  most ``--batch-cap`` sequences and 8,192 tokens, paged KV with preemption by recompute); FlexPipe's
  engine schedules micro-batches of the gear (``micro_batch_size`` = ``--batch-cap``, one in flight on
  one stage, prompts admitted up to a prefill budget of 8,192 tokens, paged KV of the planner's size);
* memory: Vidur sizes the KV pool from its own memory model; FlexPipe from the planner's
  (usable memory less weights and activations).

Measured on this host 2026-12-02 (vidur 0.0.26 from PyPI in a separate venv): Vidur could not run here:
it fetches its profiles from the Hugging Face Hub at start-up and this host has no network (the
wheel ships none; the GitHub repository's ``attention.csv`` profiles are not in the stored snapshot).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from flexpipe_dag.core.cluster import parse_cluster_profile
from flexpipe_dag.planner.gears import make_search, plan_kind, to_gear
from flexpipe_dag.planner.model_spec import load_model_spec
from flexpipe_dag.sim import SimConfig, Simulator
from flexpipe_dag.workload import load_trace
from flexpipe_dag.workload.transform import head, speedup

MAX_TOKENS = 8192  # Llama-3-8B's context: the cap on prompt + output in both simulators
#: --gpu -> (FlexPipe catalog model, Vidur device, Vidur network device, Vidur compute / network datasets)
GPUS = {
    "h100": ("H100-SXM-80GB", "h100", "h100_dgx",
             "project-vajra/dev-staging-meta-llama-llama-3-8b-h100", "project-vajra/dev-staging-h100-dgx"),
    "a100": ("A100-SXM-80GB", "a100", "a100_dgx", None, None),
}
VIDUR_MODEL = "meta-llama/Llama-3-8B"


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def build_workload(n: int):
    base = head(load_trace("azure-conv"), n)
    return base, len(base.requests) / base.duration_s


def write_vidur_trace(workload, path: Path) -> None:
    """Vidur's trace_replay CSV: one row per request, arrival in seconds from the first."""
    t0 = workload.requests[0].arrival_s
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
        for r in workload.requests:
            w.writerow(["flexpipe", f"{r.arrival_s - t0:.6f}", r.input_tokens, r.output_tokens])


def run_flexpipe(workload, gpu_model: str, batch_cap: int) -> dict:
    t0 = time.perf_counter()
    cluster = parse_cluster_profile({"cluster_id": f"one-{gpu_model}", "fleet": [{"node_id": "h", "gpu_model": gpu_model, "count": 1}]})
    model = load_model_spec("Llama-3-8B")
    search = make_search(cluster, model)
    gear = to_gear(search, "throughput", plan_kind(search, "throughput", 1))
    timing = search.cm.timings(gear)
    plan_s = time.perf_counter() - t0
    cfg = SimConfig(micro_batch_size=batch_cap, max_inflight_micro_batches=1, prefill_token_budget=MAX_TOKENS,
                    max_context_tokens=MAX_TOKENS)
    t0 = time.perf_counter()
    s = Simulator(workload, gear, timing, cfg).run().summary
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "plan_s": plan_s, "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
            "tpot_p50": s["tpot_ms"]["p50"], "tpot_p99": s["tpot_ms"]["p99"], "e2e_p50": s["e2e_ms"]["p50"],
            "rps": s["throughput_rps"], "completed": s["completed"], "preemptions": s["preemptions"],
            "kv_tokens": gear.kv_capacity_tokens}


def vidur_usable(python: str) -> str | None:
    """None when ``python`` imports vidur, else why not."""
    if not (Path(python).exists() or shutil.which(python)):
        return f"{python}: no such interpreter"
    p = subprocess.run([python, "-c", "import vidur, importlib.metadata as m; print(m.version('vidur'))"],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return f"{python} cannot import vidur: {last_line(p.stderr)}"
    print(f"vidur {p.stdout.strip()} at {python}")
    return None


def last_line(text: str) -> str:
    """The exception a traceback ends with (its line and what follows), else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return "(no output)"
    starts = [i for i, ln in enumerate(lines) if re.match(r"[A-Za-z_][\w.]*(Error|Exception)\w*: ", ln)]
    return " ".join(lines[starts[-1]:]) if starts else lines[-1]


def vidur_command(python: str, trace: Path, out: Path, gpu: str, batch_cap: int, datasets: tuple[str, str]) -> list[str]:
    _, device, network, _, _ = GPUS[gpu]
    rf = "--random_forrest_execution_time_predictor_config_"
    return [python, "-m", "vidur.main",
            "--replica_config_device", device, "--replica_config_network_device", network,
            "--replica_config_model_name", VIDUR_MODEL, "--cluster_config_num_replicas", "1",
            "--replica_config_tensor_parallel_size", "1", "--replica_config_num_pipeline_stages", "1",
            "--replica_scheduler_config_type", "vllm", "--vllm_scheduler_config_batch_size_cap", str(batch_cap),
            "--vllm_scheduler_config_max_tokens_in_batch", str(MAX_TOKENS),
            "--request_generator_config_type", "trace_replay", "--trace_request_generator_config_trace_file", str(trace),
            "--trace_request_generator_config_date", "flexpipe",
            "--trace_request_generator_config_prefill_scale_factor", "1",
            "--trace_request_generator_config_decode_scale_factor", "1",
            "--trace_request_generator_config_time_scale_factor", "1",
            "--trace_request_generator_config_max_tokens", str(MAX_TOKENS),
            "--execution_time_predictor_config_type", "random_forrest",
            f"{rf}model_profiling_dataset", datasets[0], f"{rf}network_profiling_dataset", datasets[1],
            f"{rf}prediction_max_prefill_chunk_size", str(MAX_TOKENS), f"{rf}prediction_max_batch_size", str(batch_cap),
            "--metrics_config_output_dir", str(out), "--no-metrics_config_enable_chrome_trace",
            "--no-metrics_config_store_plots", "--no-metrics_config_save_table_to_wandb"]


def run_vidur(cmd: list[str], cwd: Path, out: Path, workload, timeout_s: int) -> dict:
    """Run Vidur once; its per-request CSV (seconds) -> the same figures as FlexPipe's summary (ms)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_DISABLE_TELEMETRY": "1"}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    wall = time.perf_counter() - t0
    (cwd / "vidur.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {last_line(p.stderr)}", "wall_s": wall, "log": str(cwd / "vidur.log")}
    found = sorted(out.glob("*/request_metrics.csv"))
    if not found:
        return {"error": f"no request_metrics.csv under {out}", "wall_s": wall, "log": str(cwd / "vidur.log")}
    with found[-1].open() as f:
        rows = list(csv.DictReader(f))
    t_first = workload.requests[0].arrival_s
    arrivals = [r.arrival_s - t_first for r in workload.requests]
    ttft, tpot, e2e, ends = [], [], [], []
    for row in rows:
        rid = int(float(row["Request Id"]))
        if not 0 <= rid < len(arrivals):
            return {"error": f"request id {rid} in {found[-1]} is not one of the {len(arrivals)} written", "wall_s": wall}
        ttft.append(float(row["prefill_e2e_time"]) * 1e3)
        e2e.append(float(row["request_e2e_time"]) * 1e3)
        ends.append(arrivals[rid] + float(row["request_e2e_time"]))
        if workload.requests[rid].output_tokens > 1:
            tpot.append(float(row["decode_time_execution_plus_preemption_normalized"]) * 1e3)
    makespan = max(ends) if ends else math.nan
    return {"wall_s": wall, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50),
            "tpot_p99": pct(tpot, 99), "e2e_p50": pct(e2e, 50), "rps": len(rows) / makespan, "completed": len(rows)}


def explain(error: str, datasets: tuple[str, str]) -> str:
    if "ConnectError" in error or "LocalEntryNotFoundError" in error or "internet connection" in error:
        return (f"Vidur fetches its measured profiles from the Hugging Face Hub at start-up ({datasets[0]}, "
                f"{datasets[1]}) and cannot reach it from here; the wheel ships no profiles.")
    return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vidur-python", help="interpreter with vidur installed (default: FlexPipe's side only)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rates", default="2,4,8", help="mean request rates (req/s), comma-separated")
    ap.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    ap.add_argument("--batch-cap", type=int, default=128)
    ap.add_argument("--vidur-compute-dataset", help="Vidur's compute profile dataset (default: Vidur's for --gpu)")
    ap.add_argument("--vidur-network-dataset", help="Vidur's network profile dataset (default: Vidur's for --gpu)")
    ap.add_argument("--vidur-timeout", type=int, default=1800, help="seconds per Vidur run")
    ap.add_argument("--workdir", default="/tmp/flexpipe-vidur")
    args = ap.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    gpu_model, vdev, vnet, vds_c, vds_n = GPUS[args.gpu]
    datasets = (args.vidur_compute_dataset or vds_c, args.vidur_network_dataset or vds_n)

    base, native = build_workload(args.requests)
    print(f"workload: azure-conv first {len(base.requests)} requests ({native:.2f} req/s as recorded), "
          f"rates {', '.join(f'{r:g}' for r in rates)} req/s by time compression")
    print(f"configuration: Llama-3-8B bf16 on one {gpu_model} (Vidur: {VIDUR_MODEL} on {vdev}/{vnet}), 1 stage, TP 1, "
          f"1 replica, batch cap {args.batch_cap}, max {MAX_TOKENS} tokens per request")

    vidur_why = "no --vidur-python given" if not args.vidur_python else vidur_usable(args.vidur_python)
    if vidur_why is None and None in datasets:
        vidur_why = f"--gpu {args.gpu} needs --vidur-compute-dataset and --vidur-network-dataset"
    if vidur_why:
        print(f"Vidur: skipped ({vidur_why})")
    work = Path(args.workdir)
    rows = []
    for rate in rates:
        wl = speedup(base, rate / native)
        fp = run_flexpipe(wl, gpu_model, args.batch_cap)
        vd: dict = {"error": vidur_why} if vidur_why else {}
        if not vidur_why:
            d = work / f"rate-{rate:g}"
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            write_vidur_trace(wl, d / "trace.csv")
            cmd = vidur_command(args.vidur_python, d / "trace.csv", d / "out", args.gpu, args.batch_cap, datasets)
            print(f"rate {rate:g}: cd {d} && WANDB_MODE=disabled {' '.join(cmd)}")
            vd = run_vidur(cmd, d, d / "out", wl, args.vidur_timeout)
            if "error" in vd:
                print(f"Vidur could not run here: {vd['error']}" + (f" (log: {vd['log']})" if "log" in vd else ""))
                why = explain(vd["error"], datasets)
                if why:
                    print(f"  {why}")
                vidur_why = vd["error"]  # the same failure would repeat at every rate
        rows.append((rate, fp, vd))

    keys = [("wall_s", "wall s", "{:.2f}"), ("ttft_p50", "TTFT p50 ms", "{:.1f}"), ("ttft_p99", "TTFT p99 ms", "{:.1f}"),
            ("tpot_p50", "TPOT p50 ms", "{:.2f}"), ("tpot_p99", "TPOT p99 ms", "{:.2f}"), ("e2e_p50", "e2e p50 ms", "{:.0f}"),
            ("rps", "throughput req/s", "{:.3f}")]
    for rate, fp, vd in rows:
        print(f"\nrate {rate:g} req/s: FlexPipe planned in {fp['plan_s']:.2f} s (KV {fp['kv_tokens']} tokens), "
              f"{fp['completed']} completed, {fp['preemptions']} preemptions"
              + (f"; Vidur {vd['completed']} completed" if "completed" in vd else ""))
        print(f"  {'':18} {'FlexPipe':>10} {'Vidur':>10} {'FP/Vidur':>9}")
        for k, label, fmt in keys:
            v = vd.get(k) if "error" not in vd else None
            ratio = f"{fp[k] / v:.2f}" if v else "n/a"
            print(f"  {label:18} {fmt.format(fp[k]):>10} {fmt.format(v) if v is not None else 'n/a':>10} {ratio:>9}")
    if vidur_why:
        print(f"\nNo Vidur figures: {vidur_why}")
    print("\nDifferences: Vidur's batch times come from operator profiles measured on real GPUs (random forests); "
          "FlexPipe's from its datasheet roofline cost model with calibration factors. Vidur schedules with its vLLM "
          "policy (continuous batching, prefill-first, paged KV, recompute on preemption); FlexPipe with its gear's "
          "micro-batches (same batch cap and token budget). Vidur's wall time is the whole process "
          "(imports, profile loading / model training, simulation); FlexPipe's is the simulation alone (planning apart).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
