"""Plan quality: the throughput gear against the exhaustive oracle and against the uniform / parameters baselines.

1. 200 seeded random small heterogeneous instances (2-6 catalog GPUs on 1-3 hosts, 4-16 layers):
   estimated tokens/s of the ``throughput`` gear / the oracle's (goal: min >= 0.98). The oracle
   enumerates every ordered device sequence with the exact DP split and has no replicas, so a ratio
   above 1 means replicas helped.
2. The example fragmented clusters with Llama-3-8B and Llama-2-70B: throughput gear / ``uniform`` and
   / ``parameters`` (goal >= 1.5x where the cluster is fragmented). A baseline that cannot place the
   model at all is reported as infeasible.

All figures come from the same cost model and estimator in this run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/plan_quality.py [--instances 200]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.core.errors import InfeasibleError
from flexpipe_dag.planner.gears import candidate_plans, make_search, oracle_plans, pick, plan_kind
from flexpipe_dag.planner.instances import random_cluster, random_model
from flexpipe_dag.planner.model_spec import load_model_spec
from flexpipe_dag.planner.workload import PlanWorkload

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
SMALL = PlanWorkload(context_p95_tokens=2048, concurrency=16, prompt_tokens_mean=512, output_tokens_mean=128,
                     micro_batch_size_candidates=(1, 4, 16))


def random_instances(n: int, seed: int) -> float:
    """Print the throughput gear / oracle figures on ``n`` seeded random instances; return the least ratio."""
    ratios, plain, capacity, infeasible, t0 = [], [], [], 0, time.perf_counter()
    for i in range(n):
        rng = np.random.default_rng(seed + i)
        cluster = random_cluster(rng, int(rng.integers(2, 7)))
        model = random_model(rng, int(rng.integers(4, 17)))
        search = make_search(cluster, model, workload=SMALL)
        try:
            oracle = plan_kind(search, "oracle").estimate.tokens_per_s
        except InfeasibleError:
            infeasible += 1
            continue
        ours = plan_kind(search, "throughput").estimate.tokens_per_s
        ratios.append(ours / oracle)
        no_replicas = pick("throughput", candidate_plans(search, replicas=False), search).estimate.tokens_per_s
        plain.append(no_replicas / oracle)
        # capacity objective (what the oracle optimises): least bottleneck over micro-batch sizes
        oracle_t = min(p.plan.bottleneck_ms for p in oracle_plans(search))
        ours_t = min(min(x.bottleneck_ms for x in search.construct(b, search.min_limit(b)))
                     for b in SMALL.micro_batch_sizes_to_search() if search.min_limit(b) is not None)
        capacity.append(oracle_t / ours_t)
    r = np.array(ratios)
    print(f"random small instances: {len(r)} feasible of {n} ({infeasible} infeasible for both), "
          f"{time.perf_counter() - t0:.1f} s")
    print(f"  throughput gear / oracle tokens/s: min {r.min():.4f}  mean {r.mean():.4f}  "
          f"p5 {np.quantile(r, 0.05):.4f}  share >= 0.98: {np.mean(r >= 0.98):.3f}  "
          f"goal min >= 0.98: {'MET' if r.min() >= 0.98 else 'MISSED'}")
    q = np.array(plain)
    print(f"  same search without replicas (the oracle's space) / oracle: min {q.min():.4f}  mean {q.mean():.4f}  "
          f"share >= 0.98: {np.mean(q >= 0.98):.3f}")
    c = np.array(capacity)
    print(f"  capacity (1 / least bottleneck, the oracle's own objective) search / oracle: min {c.min():.4f}  "
          f"max {c.max():.4f}  mean {c.mean():.4f}")
    return float(r.min())


def examples() -> None:
    print("example clusters (tokens/s; ratio = throughput gear / baseline):")
    header = f"  {'cluster':22s} {'model':12s} {'conc':>4s} {'gear tok/s':>10s} {'uniform':>10s} {'ratio':>7s} " \
             f"{'params':>10s} {'ratio':>7s}"
    print(header)
    for cluster_file in ("fragmented_lab.yaml", "alibaba_openb.yaml"):
        cluster = load_cluster_profile(EXAMPLES / cluster_file)
        for model_name in ("Llama-3-8B", "Llama-2-70B"):
            model = load_model_spec(model_name)
            for conc in (64, 16):
                search = make_search(cluster, model, workload=PlanWorkload(concurrency=conc))
                try:
                    gear = plan_kind(search, "throughput").estimate.tokens_per_s
                except InfeasibleError as exc:
                    print(f"  {cluster.cluster_id:22s} {model_name:12s} {conc:4d} infeasible: {exc}")
                    continue
                cells = []
                for kind in ("uniform", "parameters"):
                    try:
                        base = plan_kind(search, kind).estimate.tokens_per_s
                        cells.append(f"{base:10.1f} {gear / base:6.2f}x")
                    except InfeasibleError:
                        cells.append(f"{'infeasible':>10s} {'inf':>7s}")
                print(f"  {cluster.cluster_id:22s} {model_name:12s} {conc:4d} {gear:10.1f} {cells[0]} {cells[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1000)
    args = parser.parse_args()
    random_instances(args.instances, args.seed)
    examples()


if __name__ == "__main__":
    main()
