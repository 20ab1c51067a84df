"""Gear-shift sensor evaluations over a long backlog of metric samples: paged vs one pass.

Fills a SQLite store with ``--days`` of 2-s metric samples of one serving run (a daily sine tide
inside the latency gear's envelope, a rise above it at the end), then evaluates
:func:`flexpipe_dag.control.service.evaluate_gear_shift` as the sensor does, tick after tick from
an empty cursor, with the shipped page size and time budget (5,000 samples, 2 s), and once as a
single unbounded pass (the baseline: what every evaluation did before paging). Prints the number of
paged evaluations, the slowest one, their total, the one-pass time, the slowest / one-pass ratio,
and whether both end on the same decision (they must).

    OMP_NUM_THREADS=1 .venv/bin/python bench/sensor_bench.py [--days 1 7]
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from flexpipe_dag.control.config import ControllerConfig
from flexpipe_dag.control.service import evaluate_gear_shift
from flexpipe_dag.control.settings import ResolvedControlSettings
from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.core.gear import Gear, GearEstimate, StagePlan
from flexpipe_dag.core.metrics import MetricSample, StageSample
from flexpipe_dag.sql.store import Store, make_engine

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "clusters"
SAMPLE_PERIOD_S = 2.0
WRITE_BATCH = 20_000


def _gear(gear_id: str, kind: str, rps_min: float, rps_max: float, stages: int) -> Gear:
    """A SmolLM2-135M gear (30 layers) on ``stages`` of the seed example's GPUs with the envelope ``[rps_min, rps_max]``."""
    bounds = [(0, 30)] if stages == 1 else [(0, 15), (15, 30)]
    return Gear(gear_id=gear_id, kind=kind, model_name="SmolLM2-135M", num_layers=30, micro_batch_size=8,
                stages=[StagePlan(stage_index=i, layer_start=a, layer_end=b, device_ids=[f"gpu_00{i + 1}"])
                        for i, (a, b) in enumerate(bounds)],
                rps_min=rps_min, rps_max=rps_max, target_p99_ms=500.0,
                estimate=GearEstimate(throughput_rps=rps_max, tokens_per_s=rps_max * 100, ttft_p50_ms=100,
                                      ttft_p99_ms=300, tpot_p50_ms=20, tpot_p99_ms=40, bottleneck_stage=0))


GEARS = [_gear("latency-1s", "latency", 0.0, 5.0, 1), _gear("throughput-2s", "throughput", 3.5, 40.0, 2)]


def _samples(days: int):
    """``days`` of 2-s samples, in batches: the tide inside latency-1s's envelope, a rise above it in the last 20 s."""
    n = int(days * 86400 / SAMPLE_PERIOD_S)
    batch = []
    for i in range(n):
        t_s = SAMPLE_PERIOD_S * (i + 1)
        rps = 12.0 if i >= n - 10 else 2.5 + 1.5 * math.sin(t_s * 2 * math.pi / 86400)
        batch.append(MetricSample(t_s=t_s, gear_id="latency-1s", source="live", rps=round(rps, 6),
                                  completed=int(rps * 2), tokens_per_s=rps * 100, queue_length=5, running=8,
                                  kv_used_fraction=0.3, ttft_p99_ms=300.0, tpot_p99_ms=40.0,
                                  stages=(StageSample(0, 0.6, 1, 10, 100),)))
        if len(batch) == WRITE_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _store(path: str, days: int) -> Store:
    db = Store(make_engine(f"sqlite:///{path}"))
    info = db.save_profile(load_cluster_profile(EXAMPLES / "seed_example.yaml"))
    db.save_gears(GEARS, info.id, db.save_model("SmolLM2-135M", "bf16", 30, {"layers": 30}))
    for batch in _samples(days):
        db.write_samples("serve-1", batch)
    return db


def run(days: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        db = _store(os.path.join(tmp, "fp.db"), days)
        fill_s = time.perf_counter() - t0
        now = time.time()
        paged = ResolvedControlSettings()
        cursor, times, ev = None, [], None
        while True:
            t0 = time.perf_counter()
            ev = evaluate_gear_shift(db, cursor, paged, run_key="serve-1", epoch_s=now)
            times.append(time.perf_counter() - t0)
            cursor = ev.cursor
            if not ev.backlog:
                break
        one_pass = ResolvedControlSettings(controller=ControllerConfig(evaluation_page_samples=1_000_000,
                                                                       evaluation_budget_s=1e9))
        t0 = time.perf_counter()
        ref = evaluate_gear_shift(db, None, one_pass, run_key="serve-1", epoch_s=now, run_key_prefix="ref:")
        one_s = time.perf_counter() - t0
        same = ev.decision is not None and ref.decision is not None and ev.decision == ref.decision
        print(f"{days} day(s), {int(days * 86400 / SAMPLE_PERIOD_S):,} samples (store filled in {fill_s:.0f} s): "
              f"{len(times)} paged evaluations, slowest {max(times):.2f} s, total {sum(times):.1f} s; "
              f"one pass {one_s:.2f} s; slowest / one pass = {max(times) / one_s:.2f}x; "
              f"same decision: {same} ({ev.decision.action if ev.decision else None})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, nargs="+", default=[1, 7], help="backlog lengths to measure (days)")
    args = parser.parse_args()
    for days in args.days:
        run(days)


if __name__ == "__main__":
    main()
