"""Cost-model error against the measured vidur A100 operator timings, per operator class and operator.

Fits the per-class efficiency factors (``flexpipe_dag.calibration.reference``) and prints, per class
and per operator, the mean / median / P90 absolute percentage error of the roofline prediction, next
to a baseline measured in the same run: the pure datasheet roofline (efficiency 1, no overhead).

    OMP_NUM_THREADS=1 .venv/bin/python bench/cost_model_error.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from flexpipe_dag.calibration.reference import fit_efficiency, load_vidur_rows, predict_ms
from flexpipe_dag.core.catalog import REFERENCE_MODEL, gpu_catalog
from flexpipe_dag.planner.cost_model import Efficiency


def ape_stats(pred: np.ndarray, meas: np.ndarray) -> str:
    ape = np.abs(pred - meas) / meas
    return f"{ape.mean():7.1%} {np.median(ape):7.1%} {np.quantile(ape, 0.9):7.1%}"


def main() -> None:
    rows = load_vidur_rows()
    fits = fit_efficiency(rows)
    ref = gpu_catalog()[REFERENCE_MODEL]
    ideal = Efficiency(1.0, 1.0, 0.0)
    print(f"vidur A100 operator rows: {len(rows)} (Llama-2-7B and -70B, 1..4096 tokens, TP 1/2/4/8); "
          f"reference {REFERENCE_MODEL}")
    print(f"{'class / operator':26s} {'rows':>5s} | fitted: {'mean':>7s} {'median':>7s} {'p90':>7s} | "
          f"datasheet roofline: {'mean':>7s} {'median':>7s} {'p90':>7s} | factors (compute, memory, overhead_us)")
    for cls, fit in sorted(fits.items()):
        group = rows[rows["op_class"] == cls]
        f, b, y = (group[c].to_numpy() for c in ("flops", "bytes_moved", "measured_ms"))
        e = fit.efficiency
        print(f"{cls:26s} {len(y):5d} |         {ape_stats(predict_ms(f, b, e, ref.peak_tflops, ref.hbm_bandwidth_gbps), y)} | "
              f"                    {ape_stats(predict_ms(f, b, ideal, ref.peak_tflops, ref.hbm_bandwidth_gbps), y)} | "
              f"({e.compute}, {e.memory}, {e.overhead_us})")
        for op, og in group.groupby("op"):
            f, b, y = (og[c].to_numpy() for c in ("flops", "bytes_moved", "measured_ms"))
            print(f"  {op:24s} {len(y):5d} |         {ape_stats(predict_ms(f, b, e, ref.peak_tflops, ref.hbm_bandwidth_gbps), y)} |")
    print("attention core: not in the vidur MLP profile; literature default, not measured here")


if __name__ == "__main__":
    main()
