"""Gear shifting vs static gears on a tide-shaped real trace, in the simulator.

Usage: python bench/shift_bench.py [--model Llama-3-8B] [--cluster examples/clusters/fragmented_lab.yaml]
                                   [--gears sim|planner] [--envelope sim|analytic] [--slo-ttft-ms 2000]
                                   [--slo-tpot-ms 200] [--duration-s 7200] [--peak-rps auto] [--peak-share 0.95]
                                   [--start-day 0] [--verbose]

What it does (issue 6, "Done when"): the Azure LLM 2023 conversation trace (19,366 real requests,
CC-BY-4.0) is time-warped so its arrival rate follows one day of the ServeGen daily tide
(Apache-2.0), compressed into ``--duration-s`` simulated seconds (default: a day in 2 h).

Gears (``--gears sim``, default): the planner proposes a shortlist of distinct configurations
(:func:`~flexpipe_dag.planner.gears.candidate_gears`); each is replayed in the simulator on the first
1,000 Azure conv requests at bisected rates, and the latency / balanced / throughput gears are chosen
by what the simulator measured (:func:`~flexpipe_dag.planner.envelope.select_operating_gears`):
envelopes ``qps_max`` = highest rate with >= 95 % of requests inside the SLO. ``--gears planner``
uses the planner's analytic picks, with simulated (``--envelope sim``) or analytic envelopes.

Each gear serves the whole replay statically; then the controller (:mod:`flexpipe_dag.control`,
seed figures) drives the same replay, shifting gears from the simulator's 2-s metric samples. A
shift's shadow warm-up takes the weight transfer time over the cluster's links
(``weight_transfer_s``), then the old gear drains while the new one admits.

Prints, all measured in this run: the config, the gears and their envelopes, SLO goodput (requests
meeting TTFT <= ``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms`` per second; defaults 2 s / 200 ms,
the simulator's) of each static gear and of dynamic shifting, the ratio dynamic / static for each
gear, shifts per simulated hour, requests lost (unfinished or rejected; must be 0), and the
controller's reason for every shift. Goal: >= 1.3x the best static gear with <= 6 shifts per hour.

``--peak-rps auto`` puts the tide's peak at ``--peak-share`` (0.95) x the largest simulated envelope:
the biggest gear can just hold the peak, the smaller ones cannot, so the tide crosses their
capacities; its trough (about half the peak for day 0) lies inside the smallest gear's envelope.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from flexpipe_dag.control import Controller, ControllerConfig, drain_time_s, migration_cost_fn, weight_transfer_s
from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.planner.envelope import refine_envelopes, select_operating_gears
from flexpipe_dag.planner.gears import candidate_gears, make_search, plan_gear_set
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
    ap.add_argument("--peak-share", type=float, default=0.95,
                    help="with --peak-rps auto: the tide's peak = this x the largest simulated envelope")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--gears", choices=("sim", "planner"), default="sim",
                    help="sim: pick latency / balanced / throughput from the planner's shortlist by simulation "
                         "(select_operating_gears); planner: the planner's analytic picks")
    ap.add_argument("--envelope", choices=("sim", "analytic"), default="sim",
                    help="with --gears planner: envelopes from the simulator (refine_envelopes) or the analytic estimate")
    ap.add_argument("--verbose", action="store_true", help="print every shift's reason as it happens")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    cluster = load_cluster_profile(args.cluster)
    spec = ModelSpec.from_builtin(args.model)
    cm = make_search(cluster, spec, dtype=args.dtype).cm
    base = load_trace("azure-conv")
    t0 = time.perf_counter()
    notes: list[str] = []
    if args.gears == "sim":
        args.envelope = "sim"
        shortlist = candidate_gears(cluster, spec, dtype=args.dtype)
        gears = select_operating_gears(shortlist, cm, base, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                                       rel_tol=0.05, notes=notes)
        notes.insert(0, f"chosen by simulation from {len(shortlist)} distinct planner candidates")
    else:
        gear_set = plan_gear_set(cluster, spec, dtype=args.dtype)
        gears, notes = gear_set.gears, list(gear_set.notes)
        if args.envelope == "sim":
            gears = refine_envelopes(gears, cm, base, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    t_env = time.perf_counter() - t0
    timings = {g.gear_id: cm.timings(g) for g in gears}

    finite_max = [g.qps_max for g in gears if math.isfinite(g.qps_max)]
    peak_rps = args.peak_share * max(finite_max) if args.peak_rps == "auto" else float(args.peak_rps)
    tide = load_tide_trace()
    workload = shape_by_tide(base, tide, compression=86400.0 / args.duration_s, start_s=86400.0 * args.start_day,
                             duration_s=args.duration_s, peak_rps=peak_rps, name="azure-conv@servegen-tide")
    out_mean = sum(r.output_tokens for r in workload.requests) / max(1, len(workload))
    sim_config = SimConfig(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    controller = Controller(ControllerConfig(target_p99_ms=sim_config.slo_ttft_ms, latency_metric="ttft_p99_ms"))

    print(f"model {spec.name} ({args.dtype}) on {cluster.cluster_id}: {len(cluster.devices)} devices")
    print(f"workload: azure-conv shaped by ServeGen tide day {args.start_day}, compressed 86400 s -> "
          f"{args.duration_s:.0f} s: {len(workload)} requests, mean {workload.mean_rate_rps:.2f} req/s, "
          f"peak {peak_rps:.2f} req/s")
    print(f"SLO: TTFT <= {sim_config.slo_ttft_ms:.0f} ms and TPOT <= {sim_config.slo_tpot_ms:.0f} ms")
    print(f"config: --gears {args.gears} --envelope {args.envelope} --slo-ttft-ms {args.slo_ttft_ms:.0f} "
          f"--slo-tpot-ms {args.slo_tpot_ms:.0f} --peak-rps {args.peak_rps} --peak-share {args.peak_share} "
          f"--duration-s {args.duration_s:.0f} --start-day {args.start_day}; controller: seed figures, latency "
          f"target = SLO TTFT; shift warm-up = weight transfer time, then drain")
    print(f"gears (planner; envelopes {'simulated on the first 1000 azure-conv requests, >= 95 % SLO attainment' if args.envelope == 'sim' else 'analytic'}"
          f"{f', {t_env:.1f} s wall' if args.envelope == 'sim' else ''}):")
    for note in notes:
        print(f"  note: {note}")
    for g in gears:
        est = g.estimate
        layout = " | ".join(f"{'+'.join(st.device_ids)}:{st.num_layers}L" for st in g.stages)
        print(f"  {g.gear_id:24s} {g.kind:10s} micro-batch {g.micro_batch_size:3d} x {g.max_inflight_micro_batches:2d}  "
              f"envelope [{g.qps_min:.2f}, {g.qps_max:.2f}] req/s  TTFT p99 {est.ttft_p99_ms:.0f} ms  "
              f"TPOT p99 {est.tpot_p99_ms:.0f} ms  [{layout}]")

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
    best_static = max(gears, key=lambda g: static[g.gear_id]["goodput_rps"])
    att = static[best_static.gear_id]["slo_attainment"]
    print(f"headroom: the best static gear ({best_static.kind}) already meets the SLO for {att:.3f} of requests, so no "
          f"controller can beat it by more than 1 / {att:.3f} = {1 / att if att > 0 else math.inf:.3f}x on this workload")
    per_hour = len(shifts) / hours
    ok = best >= 1.3 and per_hour <= 6 and _lost(dyn) == 0
    print(f"vs best static gear: {best:.3f}x; shifts per hour {per_hour:.2f}; lost {_lost(dyn)}; "
          f"goal (>= 1.3x, <= 6/h, 0 lost): {'met' if ok else 'NOT met'}")
    print(f"total wall {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
