"""Planning time: 64 devices (4 GPU types) x 80 layers on one core (goal: plan_gears under 1 s).

Prints the wall time of ``plan_gears`` (all three gears), of one throughput bottleneck search, and of
the uniform baseline through the same code path, median of ``--repeat`` runs.

    OMP_NUM_THREADS=1 .venv/bin/python bench/plan_time.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from flexpipe_dag.core.cluster import parse_cluster_profile
from flexpipe_dag.planner.gears import make_search, plan_gears, plan_kind
from flexpipe_dag.planner.model_spec import load_model_spec

FLEET = {
    "cluster_id": "bench-64",
    "fleet": [{"node_id": f"{kind.lower()}-{h}", "gpu_model": kind, "count": 8}
              for kind in ("A100-SXM-80GB", "V100-SXM2-32GB", "A10", "T4") for h in range(2)],
    "inter_node": {"bandwidth_gbps": 12.5, "latency_us": 25},
}


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default="Llama-2-70B")
    args = parser.parse_args()
    cluster = parse_cluster_profile(FLEET, "bench-64")
    model = load_model_spec(args.model)
    assert len(cluster.devices) == 64 and model.num_layers == 80
    t_gears, gears = timed(lambda: plan_gears(cluster, model), args.repeat)
    t_min, _ = timed(lambda: make_search(cluster, model).min_limit(8), args.repeat)
    t_uniform, _ = timed(lambda: plan_kind(make_search(cluster, model), "uniform"), args.repeat)
    print(f"cluster: {len(cluster.devices)} devices, 4 GPU types; model {model.name}: {model.num_layers} layers")
    print(f"plan_gears (latency + balanced + throughput): {t_gears * 1e3:8.1f} ms   goal < 1000 ms  "
          f"{'MET' if t_gears < 1 else 'MISSED'}")
    print(f"one bottleneck search (b=8, fresh tables):    {t_min * 1e3:8.1f} ms")
    print(f"uniform baseline, same code path:             {t_uniform * 1e3:8.1f} ms  "
          f"(plan_gears / uniform = {t_gears / t_uniform:.2f}x)")
    for g in gears:
        print(f"  {g.gear_id:24s} stages={g.num_stages:2d} devices={len(g.device_ids):2d} "
              f"micro-batch={g.micro_batch_size:2d} tokens/s={g.estimate.tokens_per_s:9.1f}")


if __name__ == "__main__":
    main()
