"""Gear shifting vs static gears on a tide-shaped real trace, in the simulator.

Usage: python bench/shift_bench.py [--model Llama-3-8B] [--cluster examples/clusters/fragmented_lab.yaml]
                                   [--duration-s 7200] [--peak-rps auto] [--start-day 0] [--verbose]

What it does (issue 6, "Done when"): the Azure LLM 2023 conversation trace (19,366 real requests,
CC-BY-4.0) is time-warped so its arrival rate follows one day of the ServeGen daily tide
(Apache-2.0), compressed into ``--duration-s`` simulated seconds (default: a day in 2 h). The
planner's latency / balanced / throughput gears for ``--model`` on ``--cluster`` each serve the
whole replay statically; then the controller (:mod:`flexpipe_dag.control`, seed figures) drives
the same replay, shifting gears from the simulator's 2-s metric samples. A shift's shadow warm-up
takes the weight transfer time over the cluster's links (``weight_transfer_s``), then the old gear
drains while the new one admits.

Prints, all measured in this run: SLO goodput (requests meeting TTFT <= 2 s and TPOT <= 200 ms per
second; the simulator's default SLO) of each static gear and of dynamic shifting, the ratio
dynamic / static for each gear, shifts per simulated hour, requests lost (unfinished or rejected;
must be 0), and the controller's reason for every shift. Goal: >= 1.3x the best static gear with
<= 6 shifts per hour.

``--peak-rps auto`` puts the tide's peak at 1.25 x the largest gear envelope (``qps_max``) and so
its trough far below the smallest: the load the gears were planned to split between them.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from flexpipe_dag.control import Controller, ControllerConfig, drain_time_s, migration_cost_fn, weight_transfer_s
from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.planner.gears import make_search, plan_gears
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.sim import SimConfig, Simulator
from flexpipe_dag.workload import load_tide_trace, load_trace, shape_by_tide

ROOT = Path(__file__).resolve().parents[1]


def _lost(summary: dict) -> int:
    return int(summary["unfinished"]) + int(summary["rejected"])


def run_static(workload, gear, timing, sim_config: SimConfig) -> dict:
    """Serve the whole replay on one gear; the summary of the simulator."""
    return Simulator(workload, gear, timing, sim_config).run().summary


def run_dynamic(workload, gears, timings, start_gear, sim_config: SimConfig, controller: Controller,
                cluster, spec, dtype: str, output_tokens_mean: float, verbose: bool):
    """Serve the replay with the controller deciding at every metric sample; returns (summary, shifts)."""
    layer_bytes = [spec.layer_weight_bytes(dtype)] * spec.num_layers
    extras = dict(embedding_bytes=spec.first_stage_extra_bytes(dtype), lm_head_bytes=spec.last_stage_extra_bytes(dtype))
    by_id = {g.gear_id: g for g in gears}
    sim = Simulator(workload, start_gear, timings[start_gear.gear_id], sim_config)
    last = {"sample": None}

    def drain_s(old_gear) -> float:
        s = last["sample"]
        if s is None:
            return 0.0
        tpot = s.tpot_p50_ms if s.tpot_p50_ms is not None else (old_gear.estimate.tpot_p50_ms if old_gear.estimate else 0.0)
        # in-flight requests are on average half-way through their output
        return drain_time_s(s.running, output_tokens_mean / 2.0, tpot)

    cost_fn = migration_cost_fn(cluster, layer_bytes, drain_s=drain_s, **extras)
    state, shifts = None, []
    period = sim_config.sample_period_s
    while not sim.finished:
        samples = sim.advance(sim.now_s + period)
        if not samples:
            continue
        last["sample"] = samples[-1]
        state, decision = controller.decide(state, samples, gears, migration_cost_s=cost_fn, now_s=samples[-1].t_s)
        if decision.action == "shift":
            old, new = by_id[decision.from_gear_id], by_id[decision.to_gear_id]
            warm_s = weight_transfer_s(old, new, cluster, layer_bytes, **extras)
            sim.shift_gear(new, timings[new.gear_id], ready_in_s=warm_s)
            shifts.append((decision, warm_s))
            if verbose:
                print(f"  t={decision.t_s:7.0f} s  {decision.reason}  [warm-up {warm_s:.2f} s]")
    return sim.result().summary, shifts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Llama-3-8B")
    ap.add_argument("--cluster", default=str(ROOT / "examples/clusters/fragmented_lab.yaml"))
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--duration-s", type=float, default=7200.0, help="simulated seconds one tide day is compressed into")
    ap.add_argument("--start-day", type=int, default=0, help="which day of the 14-day ServeGen tide")
    ap.add_argument("--peak-rps", default="auto", help="peak arrival rate, req/s, or 'auto'")
    ap.add_argument("--verbose", action="store_true", help="print every shift's reason as it happens")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    cluster = load_cluster_profile(args.cluster)
    spec = ModelSpec.from_builtin(args.model)
    gears = plan_gears(cluster, spec, dtype=args.dtype)
    cm = make_search(cluster, spec, dtype=args.dtype).cm
    timings = {g.gear_id: cm.timings(g) for g in gears}

    finite_max = [g.qps_max for g in gears if math.isfinite(g.qps_max)]
    peak_rps = 1.25 * max(finite_max) if args.peak_rps == "auto" else float(args.peak_rps)
    base = load_trace("azure-conv")
    tide = load_tide_trace()
    workload = shape_by_tide(base, tide, compression=86400.0 / args.duration_s, start_s=86400.0 * args.start_day,
                             duration_s=args.duration_s, peak_rps=peak_rps, name="azure-conv@servegen-tide")
    out_mean = sum(r.output_tokens for r in workload.requests) / max(1, len(workload))
    sim_config = SimConfig()
    controller = Controller(ControllerConfig(target_p99_ms=sim_config.slo_ttft_ms, latency_metric="ttft_p99_ms"))

    print(f"model {spec.name} ({args.dtype}) on {cluster.cluster_id}: {len(cluster.devices)} devices")
    print(f"workload: azure-conv shaped by ServeGen tide day {args.start_day}, compressed 86400 s -> "
          f"{args.duration_s:.0f} s: {len(workload)} requests, mean {workload.mean_rate_rps:.2f} req/s, "
          f"peak {peak_rps:.2f} req/s")
    print(f"SLO: TTFT <= {sim_config.slo_ttft_ms:.0f} ms and TPOT <= {sim_config.slo_tpot_ms:.0f} ms")
    print("gears (planner):")
    for g in gears:
        est = g.estimate
        print(f"  {g.gear_id:28s} {g.kind:10s} stages {g.num_stages} devices {len(g.device_ids)} "
              f"micro-batch {g.micro_batch_size:3d} x {g.max_inflight_micro_batches:2d}  envelope "
              f"[{g.qps_min:.2f}, {g.qps_max:.2f}] req/s  est TTFT p99 {est.ttft_p99_ms:.0f} ms" if est else "")

    static = {}
    for g in gears:
        t0 = time.perf_counter()
        static[g.gear_id] = run_static(workload, g, timings[g.gear_id], sim_config)
        s = static[g.gear_id]
        print(f"static {g.kind:10s}: goodput {s['goodput_rps']:.3f} req/s, SLO attainment "
              f"{s['slo_attainment']:.3f}, lost {_lost(s)} ({s['unfinished']} unfinished, {s['rejected']} rejected) "
              f"[{time.perf_counter() - t0:.1f} s wall]")

    # start in the gear whose envelope holds the opening load (else the smallest)
    opening = workload.requests[min(len(workload) - 1, 200)].arrival_s
    opening_rps = 200 / opening if opening > 0 else 0.0
    fitting = [g for g in gears if g.qps_min <= opening_rps <= g.qps_max]
    start = (fitting or sorted(gears, key=lambda g: g.qps_max))[0]
    t0 = time.perf_counter()
    dyn, shifts = run_dynamic(workload, gears, timings, start, sim_config, controller, cluster, spec, args.dtype,
                              out_mean, args.verbose)
    hours = dyn["makespan_s"] / 3600.0
    print(f"dynamic (start {start.kind}): goodput {dyn['goodput_rps']:.3f} req/s, SLO attainment "
          f"{dyn['slo_attainment']:.3f}, lost {_lost(dyn)} ({dyn['unfinished']} unfinished, {dyn['rejected']} rejected), "
          f"{len(shifts)} shifts = {len(shifts) / hours:.2f} per simulated hour [{time.perf_counter() - t0:.1f} s wall]")
    for d, warm in shifts:
        print(f"  t={d.t_s:7.0f} s  {d.reason}  [warm-up {warm:.2f} s]")

    ratios = {}
    for g in gears:
        sg = static[g.gear_id]["goodput_rps"]
        ratios[g.gear_id] = dyn["goodput_rps"] / sg if sg > 0 else math.inf
        print(f"goodput dynamic / static {g.kind:10s} = {ratios[g.gear_id]:.3f}")
    best = min(ratios.values())
    per_hour = len(shifts) / hours
    ok = best >= 1.3 and per_hour <= 6 and _lost(dyn) == 0
    print(f"vs best static gear: {best:.3f}x; shifts per hour {per_hour:.2f}; lost {_lost(dyn)}; "
          f"goal (>= 1.3x, <= 6/h, 0 lost): {'met' if ok else 'NOT met'}")
    print(f"total wall {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
