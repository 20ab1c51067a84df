"""Simulator fidelity: predicted vs measured TTFT / TPOT for the same gear and workload on the real runtime.

One 2-stage gear on this host's measured devices (the probe's CPU workers, or GPUs) serves real
Azure-conv-length prompts (bundled trace, capped lengths, all arriving at once). The serving
simulator replays the same requests (same prompt and output lengths) through the same gear with
(a) the cost model from the probed profile and (b) the cost model calibrated on a *separate* warm-up
batch through the same pipeline (out of sample). Printed: P50 / P99 of TTFT and TPOT, measured and
predicted, and predicted / measured ratios.

With ``--chunked-prefill-tokens N`` the measured batch is served a second time by a pipeline whose
scheduler cuts prompts into chunks of an N-token micro-batch budget, and the simulator replays it with
the same rule (``SimConfig.chunked_prefill``) and the same two cost models (the calibration still
comes from the whole-prompt warm-up): the check that the simulator's chunked-prefill figures hold.

Usage: OMP_NUM_THREADS=1 python bench/fidelity_bench.py [--num-requests 24] [--warmup-requests 16]
       [--max-prompt-tokens 64] [--chunked-prefill-tokens N]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _pcts(values: list[float]) -> tuple[float, float]:
    import numpy as np

    arr = np.asarray([v for v in values if v is not None], dtype=float)
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def run_fidelity(num_requests: int = 24, warmup_requests: int = 16, max_prompt_tokens: int = 64,
                 max_new_tokens: int = 16, micro_batch_size: int = 8, chunked_prefill_tokens: int | None = None) -> dict:
    """Measure, simulate and compare (see module docstring); returns the figures (with
    ``chunked_prefill_tokens``, the chunked run's under ``"chunked"``)."""
    from flexpipe_dag.calibration.calibrate import calibrate
    from flexpipe_dag.core.gear import Gear, StagePlan
    from flexpipe_dag.planner.cost_model import CostModel
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.profiling.probe import ProbeSettings, probe_host
    from flexpipe_dag.runtime.batch import prompts_from_trace, to_requests
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint
    from flexpipe_dag.runtime.observations import ObservationCollector
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
    from flexpipe_dag.sim.config import SimConfig
    from flexpipe_dag.sim.engine import Simulator
    from flexpipe_dag.workload.bundled import bundled_path

    cluster = probe_host("fidelity-host", ProbeSettings(num_cpu_workers=2))
    devices = [d.device_id for d in cluster.devices][:2]
    ckpt = resolve_checkpoint()
    spec = load_model_spec("SmolLM2-135M")
    half = ckpt.num_layers // 2
    gear = Gear(gear_id="fidelity-2s", kind="manual", model_name=spec.name, dtype="fp32", num_layers=ckpt.num_layers,
                stages=[StagePlan(stage_index=0, layer_start=0, layer_end=half, device_ids=[devices[0]]),
                        StagePlan(stage_index=1, layer_start=half, layer_end=ckpt.num_layers, device_ids=[devices[1]])],
                micro_batch_size=micro_batch_size, max_inflight_micro_batches=2, kv_capacity_tokens=8192,
                cluster_id=cluster.cluster_id)
    tok = ckpt.tokenizer()
    rows = prompts_from_trace(bundled_path("azure-conv"), tok, num_requests=warmup_requests + num_requests,
                              max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens)
    reqs = to_requests(rows, tok, ckpt.eos_token_ids())
    warm, measured_reqs = reqs[:warmup_requests], reqs[warmup_requests:]
    with PipelineRuntime(gear, ckpt) as rt:
        collector = ObservationCollector(rt, "fidelity")
        rt.generate(warm)
        observations = collector.collect()
        measured = _measure(rt, measured_reqs)
    cal = calibrate(spec, cluster, observations, dtype="fp32")
    models = {"profile": CostModel(spec, cluster, dtype="fp32"), "calibrated": cal.cost_model(spec, cluster)}
    config = SimConfig(micro_batch_size=gear.micro_batch_size, max_inflight_micro_batches=gear.max_inflight_micro_batches)
    out = {**_compare(measured, gear, models, config, Simulator), "calibration": cal.summary_lines()}
    if chunked_prefill_tokens:
        opts = RuntimeOptions(max_tokens_per_micro_batch=chunked_prefill_tokens, chunked_prefill=True)
        with PipelineRuntime(gear, ckpt, opts) as rt:
            rt.generate(warm[:2])  # first-step allocations, as the whole-prompt run had its warm-up
            measured = _measure(rt, [dataclasses.replace(r, request_id=f"c-{r.request_id}") for r in measured_reqs])
        config = dataclasses.replace(config, prefill_token_budget=chunked_prefill_tokens, chunked_prefill=True)
        out["chunked"] = {**_compare(measured, gear, models, config, Simulator), "tokens": chunked_prefill_tokens}
    return out


def _measure(rt, requests) -> dict:
    """Serve ``requests`` (all at once) on ``rt``: their lengths and the measured TTFT / TPOT percentiles."""
    from flexpipe_dag.workload.request import Request as SimRequest
    from flexpipe_dag.workload.request import Workload

    t0 = time.monotonic()
    outputs = list(rt.generate(requests))
    wall_s = time.monotonic() - t0
    workload = Workload.from_requests(
        [SimRequest(o.request_id, 0.0, len(o.prompt_token_ids), len(o.output_token_ids)) for o in outputs],
        name="fidelity")
    return {"workload": workload, "ttft_ms": _pcts([o.ttft_s * 1e3 for o in outputs]),
            "tpot_ms": _pcts([o.tpot_s * 1e3 for o in outputs if o.tpot_s is not None]), "wall_s": wall_s}


def _compare(measured: dict, gear, models: dict, config, simulator) -> dict:
    """The measured figures and each cost model's simulated ones for the same requests."""
    out = {"measured": {k: measured[k] for k in ("ttft_ms", "tpot_ms", "wall_s")}}
    for name, cm in models.items():
        frame = simulator(measured["workload"], gear, cm.timings(gear), config).run().requests
        out[name] = {"ttft_ms": _pcts(frame["ttft_ms"].tolist()), "tpot_ms": _pcts(frame["tpot_ms"].dropna().tolist()),
                     "makespan_s": float(frame["finish_s"].max()) if "finish_s" in frame else None}
    return out


def _print_rows(fig: dict, title: str) -> None:
    m = fig["measured"]
    print(title)
    print(f"{'':12s} {'TTFT p50':>10s} {'TTFT p99':>10s} {'TPOT p50':>10s} {'TPOT p99':>10s}   (ms)")
    print(f"{'measured':12s} {m['ttft_ms'][0]:10.1f} {m['ttft_ms'][1]:10.1f} {m['tpot_ms'][0]:10.1f} {m['tpot_ms'][1]:10.1f}")
    for name in ("profile", "calibrated"):
        p = fig[name]
        print(f"{'sim ' + name:12s} {p['ttft_ms'][0]:10.1f} {p['ttft_ms'][1]:10.1f} {p['tpot_ms'][0]:10.1f} {p['tpot_ms'][1]:10.1f}"
              f"   predicted/measured: TTFT p50 {p['ttft_ms'][0] / m['ttft_ms'][0]:.2f}x, "
              f"TPOT p50 {p['tpot_ms'][0] / m['tpot_ms'][0]:.2f}x")


def print_fidelity(fig: dict) -> None:
    _print_rows(fig, "whole-prompt prefill")
    if "chunked" in fig:
        _print_rows(fig["chunked"], f"chunked prefill, {fig['chunked']['tokens']} tokens per micro-batch")
    for line in fig["calibration"]:
        print(f"calibration (warm-up batch, out of sample): {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--warmup-requests", type=int, default=16)
    ap.add_argument("--max-prompt-tokens", type=int, default=64)
    ap.add_argument("--chunked-prefill-tokens", type=int, default=None)
    args = ap.parse_args()
    print_fidelity(run_fidelity(args.num_requests, args.warmup_requests, max_prompt_tokens=args.max_prompt_tokens,
                                chunked_prefill_tokens=args.chunked_prefill_tokens))


if __name__ == "__main__":
    main()
