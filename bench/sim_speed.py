"""Simulator speed: the full Azure conv trace (19,366 requests, ~58 min) through a 4-stage gear.

Usage: python bench/sim_speed.py [--trace azure-conv] [--repeat 1] [--profile] [--exact-baseline]

Prints wall time, simulated seconds per wall second, iterations simulated, and (as the in-run
baseline) the time just to load the trace. Goal (issue 4): the whole trace in under 20 s on one core.
Two gears: a table-driven one (LinearStageTiming) and, when the planner is present, the planner's
4-stage balanced gear for Llama-2-7B on examples/clusters/fragmented_lab.yaml with its roofline cost
model (``--exact-baseline`` also times it without the decode-time memo, and prints the speed ratio
and the TTFT/TPOT P50 difference). The table stage costs are a Llama-2-7B-like split over four A100-class stages (per stage: prefill
0.03 ms/token + 1.5 ms, decode 2 ms + 0.04 ms/sequence + 0.1 us/context token, 0.2 ms hop).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from flexpipe_dag.sim import LinearStageTiming, SimConfig, Simulator, manual_gear
from flexpipe_dag.workload import load_trace


def bench_gear():
    gear = manual_gear([8, 8, 8, 8], gear_id="bench-4stage", micro_batch_size=64, max_inflight_micro_batches=4,
                       kv_block_size_tokens=16, kv_capacity_tokens=400_000)
    timing = LinearStageTiming.uniform(4, prefill_fixed_ms=1.5, prefill_per_token_ms=0.03, decode_fixed_ms=2.0,
                                       decode_per_seq_ms=0.04, decode_per_context_token_ms=0.0001,
                                       transfer_fixed_ms=0.2, transfer_per_token_ms=0.0001)
    return gear, timing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="azure-conv")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--exact-baseline", action="store_true", help="also time the planner gear without the decode memo")
    args = ap.parse_args()
    t0 = time.perf_counter()
    workload = load_trace(args.trace)
    load_s = time.perf_counter() - t0
    gear, timing = bench_gear()
    walls = []
    for _ in range(args.repeat):
        sim = Simulator(workload, gear, timing, SimConfig())
        t0 = time.perf_counter()
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
        result = sim.run()
        if args.profile:
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
        walls.append(time.perf_counter() - t0)
    wall = min(walls)
    s = result.summary
    sim_s = s["makespan_s"]
    print(f"trace {args.trace}: {s['requests']} requests, {workload.duration_s:.0f} s of arrivals; load {load_s:.2f} s")
    print(f"gear {gear.gear_id}: 4 stages, micro-batch {gear.micro_batch_size}, {gear.max_inflight_micro_batches} in flight, "
          f"KV {gear.kv_capacity_tokens} tokens")
    print(f"simulate wall: {wall:.2f} s (best of {len(walls)}); simulated {sim_s:.0f} s -> {sim_s / wall:.0f} simulated s per wall s; "
          f"goal < 20 s: {'met' if wall < 20 else 'NOT met'}")
    print(f"samples {len(result.samples)}, completed {s['completed']}, preemptions {s['preemptions']}, "
          f"TTFT p99 {s['ttft_ms']['p99']:.0f} ms, TPOT p99 {s['tpot_ms']['p99']:.1f} ms, {s['tokens_per_s']:.0f} tok/s")
    _planner_gear_bench(workload, args.exact_baseline)
    return 0


def _planner_gear_bench(workload, exact_baseline: bool) -> None:
    from pathlib import Path

    try:
        from flexpipe_dag.core.cluster import load_cluster_profile
        from flexpipe_dag.planner.cost_model import CostModel
        from flexpipe_dag.planner.gears import plan_gears
        from flexpipe_dag.planner.model_spec import load_model_spec
    except ImportError as exc:
        print(f"planner gear: skipped ({exc})")
        return
    cluster = load_cluster_profile(Path(__file__).resolve().parents[1] / "examples" / "clusters" / "fragmented_lab.yaml")
    model = load_model_spec("Llama-2-7B")
    gears = [g for g in plan_gears(cluster, model) if g.num_stages == 4]
    if not gears:
        print("planner gear: no 4-stage gear planned; skipped")
        return
    gear = next((g for g in gears if g.kind == "balanced"), gears[0])
    timing = CostModel(model, cluster).timings(gear)
    runs = [("memo", SimConfig())] + ([("exact", SimConfig(decode_context_quantum_tokens=0))] if exact_baseline else [])
    walls, sums = {}, {}
    for name, cfg in runs:
        t0 = time.perf_counter()
        sums[name] = Simulator(workload, gear, timing, cfg).run().summary
        walls[name] = time.perf_counter() - t0
    s = sums["memo"]
    print(f"planner gear {gear.gear_id} (roofline cost model, micro-batch {gear.micro_batch_size}, "
          f"{gear.max_inflight_micro_batches} in flight): wall {walls['memo']:.2f} s, "
          f"{s['makespan_s'] / walls['memo']:.0f} simulated s per wall s; goal < 20 s: {'met' if walls['memo'] < 20 else 'NOT met'}")
    if exact_baseline:
        e = sums["exact"]
        print(f"  exact (no memo) wall {walls['exact']:.2f} s -> memo speed-up x{walls['exact'] / walls['memo']:.2f}; "
              f"TTFT P50 diff {abs(s['ttft_ms']['p50'] - e['ttft_ms']['p50']) / e['ttft_ms']['p50'] * 100:.4f} %, "
              f"TPOT P50 diff {abs(s['tpot_ms']['p50'] - e['tpot_ms']['p50']) / e['tpot_ms']['p50'] * 100:.4f} %")


if __name__ == "__main__":
    raise SystemExit(main())
