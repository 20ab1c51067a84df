"""Analytic envelope (``estimate_plan``'s ``rps_at_envelope``) vs the simulated one (``measure_envelope``).

For each fleet x model (infeasible pairs skipped) and each gear of ``plan_gears`` plus
``candidate_gears`` (deduplicated by layout), prints the analytic envelope, the simulated ``rps_max``
on the first ``--num-requests`` requests of the trace at the same SLO, and their ratio. The analytic
figure is computed for the trace's own prompt / output means, prompt-length CV and arrival
burstiness (:func:`trace_workload`), as a planner fed that trace would. Prints figures; no asserts.

Usage: PYTHONPATH=. python bench/estimate_fidelity.py [--trace azure-conv|azure-code] [--quick]
       [--num-requests 600] [--fleets lab,openb,seed] [--models Llama-3-8B,Llama-2-70B]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from flexpipe_dag.calibration.rescore import plan_from_gear
from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.core.errors import InfeasibleError
from flexpipe_dag.planner.envelope import measure_envelope, reference_slice
from flexpipe_dag.planner.estimate import estimate_plan
from flexpipe_dag.planner.gears import candidate_gears, make_search, plan_gears
from flexpipe_dag.planner.model_spec import load_model_spec
from flexpipe_dag.planner.workload import PlanWorkload
from flexpipe_dag.workload.bundled import load_trace
from flexpipe_dag.workload.request import Workload

FLEETS = {"lab": "examples/clusters/fragmented_lab.yaml", "openb": "examples/clusters/alibaba_openb.yaml",
          "seed": "examples/clusters/seed_example.yaml"}


def trace_workload(ref: Workload, base: PlanWorkload) -> PlanWorkload:
    """``base`` with the trace's prompt / output means, prompt CV and arrival burstiness.

    Burstiness is the index of dispersion of arrival counts in windows holding about 16 arrivals
    on average (the time scale of a TTFT SLO at the envelope), used as Kingman's ``c_a^2``
    (Whitt 1982, renewal approximation of a point process).
    """
    a = np.array([r.arrival_s for r in ref.requests])
    prompt = np.array([r.input_tokens for r in ref.requests], dtype=float)
    out = np.array([r.output_tokens for r in ref.requests], dtype=float)
    win = 16 * (a[-1] - a[0]) / max(1, len(a) - 1)
    counts = np.histogram(a, bins=np.arange(a[0], a[-1] + win, win))[0]
    idc = float(counts.var() / counts.mean()) if counts.mean() > 0 else 1.0
    return dataclasses.replace(base, prompt_tokens_mean=max(1, int(prompt.mean())),
                               output_tokens_mean=max(1, int(out.mean())),
                               prompt_tokens_cv=float(prompt.std() / prompt.mean()), arrival_scv=max(idc, 0.0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="azure-conv")
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--quick", action="store_true", help="plan_gears only (no candidate_gears)")
    ap.add_argument("--fleets", default="lab,openb,seed")
    ap.add_argument("--models", default="Llama-3-8B,Llama-2-70B")
    args = ap.parse_args()
    trace = load_trace(args.trace)
    ref, _ = reference_slice(trace, args.num_requests)
    print(f"trace {args.trace}, {args.num_requests} requests, SLO TTFT 2000 ms / TPOT 200 ms at 95 %")
    print(f"{'fleet':6} {'model':12} {'gear':28} {'b':>3} {'M':>3} {'analytic':>9} {'sim':>7} {'ratio':>6} {'s':>5}")
    for fleet in args.fleets.split(","):
        cluster = load_cluster_profile(FLEETS[fleet])
        for model_name in args.models.split(","):
            model = load_model_spec(model_name)
            try:
                gears = plan_gears(cluster, model)
                if not args.quick:
                    gears += candidate_gears(cluster, model)
            except InfeasibleError as exc:
                print(f"{fleet:6} {model_name:12} infeasible: {exc}")
                continue
            search = make_search(cluster, model, workload=trace_workload(ref, PlanWorkload()))
            seen = set()
            for g in gears:
                key = (g.micro_batch_size, g.max_inflight_micro_batches, tuple((tuple(s.device_ids), s.num_layers) for s in g.stages))
                if key in seen:
                    continue
                seen.add(key)
                est = estimate_plan(search, plan_from_gear(search, g))
                t0 = time.perf_counter()
                env = measure_envelope(g, search.cm.timings(g), trace, num_requests=args.num_requests, rel_tol=0.05,
                                       start_rps=max(est.rps_at_envelope, 0.05))
                ratio = est.rps_at_envelope / env.rps_max if env.rps_max > 0 else float("inf")
                print(f"{fleet:6} {model_name:12} {g.gear_id:28} {g.micro_batch_size:3d} {g.max_inflight_micro_batches:3d} "
                      f"{est.rps_at_envelope:9.2f} {env.rps_max:7.2f} {ratio:6.2f} {time.perf_counter() - t0:5.1f}", flush=True)


if __name__ == "__main__":
    main()
