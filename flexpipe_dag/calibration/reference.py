"""Fit the cost model's per-class efficiency factors to measured A100 operator times.

Data: the vidur A100 operator profile (microsoft/vidur, MIT; a median-only slice in
``flexpipe_dag/data/profiling/vidur_a100/``): per-operator median times (ms) of Llama-2-7B and
Llama-2-70B layers at 259 token counts (1..4096) and tensor-parallel degrees 1, 2, 4, 8.

For each operator class the fit chooses ``(compute, memory, overhead_us)`` minimising the mean
squared log error of ``overhead + max(F / (P compute), B / (W memory))`` over every measured row of
that class, by a coarse-to-fine grid search (numpy only). The reference device is the catalog's
A100-SXM-80GB (312 TFLOP/s bf16, 2039 GB/s). The ``attention`` class is not in this profile; it
keeps literature defaults (see :data:`ATTENTION_DEFAULT`).

Run ``python -m flexpipe_dag.calibration.reference --write`` to refresh
``flexpipe_dag/data/profiling/a100_efficiency.yaml`` (the cost model's defaults).
"""

from __future__ import annotations

import argparse
import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import Any, SupportsInt, cast

import numpy as np
import pandas as pd
import yaml

from flexpipe_dag.core.catalog import REFERENCE_MODEL, gpu_catalog
from flexpipe_dag.planner.cost_model import EFFICIENCY_FILE, Efficiency
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.planner.operators import VIDUR_OP_CLASS, operator_work

VIDUR_FILES = ("profiling/vidur_a100/llama2_7b_mlp_median.csv", "profiling/vidur_a100/llama2_70b_mlp_median.csv")
#: attention core (QK^T, softmax, x V) is not in the vidur MLP profile. FlashAttention-2 reaches
#: 50-73 % of A100 peak in the forward pass (Dao 2023, Fig. 5); paged decode attention is
#: bandwidth-bound, assumed at 70 % of HBM bandwidth. Not fitted.
ATTENTION_DEFAULT = Efficiency(compute=0.5, memory=0.7, overhead_us=5.0)


@dataclass(frozen=True)
class ClassFit:
    """One operator class's fitted factors and its prediction error on the measured rows."""

    op_class: str
    efficiency: Efficiency
    num_rows: int
    mape: float          # mean |pred - meas| / meas
    median_ape: float
    p90_ape: float


def load_vidur_rows() -> pd.DataFrame:
    """Long table of measured operators: ``model, op, op_class, num_tokens, tp, flops, bytes_moved, measured_ms``."""
    rows = []
    base = importlib.resources.files("flexpipe_dag.data")
    for rel in VIDUR_FILES:
        df = pd.read_csv(base.joinpath(rel).open())
        for cfg, group in df.groupby(["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size"]):
            heads, kv, hidden, inter, vocab = (int(cast(SupportsInt, x)) for x in cfg)  # integer CSV columns
            spec = ModelSpec(name=Path(rel).stem, num_layers=1, hidden_size=hidden, num_heads=heads,
                             num_kv_heads=kv, head_dim=hidden // heads, intermediate_size=inter,
                             vocab_size=vocab, source=rel)
            for op, cls in VIDUR_OP_CLASS.items():
                col = f"{op}_median_ms"
                for n, tp, ms in zip(group["num_tokens"], group["num_tensor_parallel_workers"], group[col]):
                    w = operator_work(spec, op, float(n), "fp16", int(tp))
                    rows.append((spec.name, op, cls, int(n), int(tp), w.flops, w.bytes_moved, float(ms)))
    out = pd.DataFrame(rows, columns=["model", "op", "op_class", "num_tokens", "tp", "flops", "bytes_moved", "measured_ms"])
    return out[out["measured_ms"] > 0].reset_index(drop=True)


def predict_ms(flops: np.ndarray, bytes_moved: np.ndarray, eff: Efficiency, peak_tflops: float,
               hbm_bandwidth_gbps: float) -> np.ndarray:
    """Roofline prediction for one kernel per row, ms (the cost model's formula)."""
    return eff.overhead_us / 1e3 + np.maximum(flops / (peak_tflops * 1e9 * eff.compute),
                                              bytes_moved / (hbm_bandwidth_gbps * 1e6 * eff.memory))


def _grid_fit(tc_unit: np.ndarray, tm_unit: np.ndarray, log_y: np.ndarray) -> tuple[float, float, float]:
    """Minimise mean (log(o + max(tc/c, tm/m)) - log y)^2 over a zooming grid of (c, m, o_ms)."""
    c_lo, c_hi, m_lo, m_hi, o_lo, o_hi = 0.02, 1.0, 0.02, 1.0, 0.0, 0.03
    best = (1.0, 1.0, 0.0, np.inf)
    for _ in range(4):
        cs = np.linspace(c_lo, c_hi, 24)
        ms = np.linspace(m_lo, m_hi, 24)
        os_ = np.linspace(o_lo, o_hi, 16)
        tm = tm_unit[None, :] / ms[:, None]                        # (M, N)
        for c in cs:
            base = np.maximum(tc_unit[None, :] / c, tm)             # (M, N)
            for o in os_:
                err = np.mean((np.log(o + base) - log_y) ** 2, axis=1)
                j = int(np.argmin(err))
                if err[j] < best[3]:
                    best = (float(c), float(ms[j]), float(o), float(err[j]))
        c, m, o, _ = best
        dc, dm, do = (c_hi - c_lo) / 8, (m_hi - m_lo) / 8, (o_hi - o_lo) / 8
        c_lo, c_hi = max(0.01, c - dc), min(1.0, c + dc)
        m_lo, m_hi = max(0.01, m - dm), min(1.0, m + dm)
        o_lo, o_hi = max(0.0, o - do), o + do
    return best[0], best[1], best[2]


def fit_efficiency(rows: pd.DataFrame | None = None) -> dict[str, ClassFit]:
    """Fit ``Efficiency`` per operator class to the vidur rows (A100-SXM-80GB roofline)."""
    rows = load_vidur_rows() if rows is None else rows
    ref = gpu_catalog()[REFERENCE_MODEL]
    out: dict[str, ClassFit] = {}
    for cls, group in rows.groupby("op_class"):
        tc_unit = group["flops"].to_numpy() / (ref.peak_tflops * 1e9)       # ms at 100 % of peak
        tm_unit = group["bytes_moved"].to_numpy() / (ref.hbm_bandwidth_gbps * 1e6)
        y = group["measured_ms"].to_numpy()
        c, m, o = _grid_fit(tc_unit, tm_unit, np.log(y))
        eff = Efficiency(compute=round(c, 4), memory=round(m, 4), overhead_us=round(o * 1e3, 3))
        pred = predict_ms(group["flops"].to_numpy(), group["bytes_moved"].to_numpy(), eff,
                          ref.peak_tflops, ref.hbm_bandwidth_gbps)
        ape = np.abs(pred - y) / y
        out[str(cls)] = ClassFit(str(cls), eff, len(y), float(ape.mean()), float(np.median(ape)),
                                 float(np.quantile(ape, 0.9)))
    return out


def efficiency_document(fits: dict[str, ClassFit]) -> dict[str, Any]:
    """The YAML document the cost model loads: fitted classes + the attention default."""
    classes: dict[str, dict[str, float | str]] = {cls: {"compute": f.efficiency.compute, "memory": f.efficiency.memory,
                     "overhead_us": f.efficiency.overhead_us, "fit_rows": f.num_rows,
                     "fit_mape": round(f.mape, 4)} for cls, f in sorted(fits.items())}
    a = ATTENTION_DEFAULT
    classes["attention"] = {"compute": a.compute, "memory": a.memory, "overhead_us": a.overhead_us,
                            "fit_rows": 0, "note": "not in the vidur MLP profile; literature default"}
    return {"reference_device": REFERENCE_MODEL,
            "source": "fitted by flexpipe_dag.calibration.reference to microsoft/vidur A100 profiling (MIT)",
            "op_classes": classes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fit cost-model efficiency factors to the vidur A100 profile.")
    parser.add_argument("--write", action="store_true", help=f"write flexpipe_dag/data/{EFFICIENCY_FILE}")
    args = parser.parse_args(argv)
    doc = efficiency_document(fit_efficiency())
    text = yaml.safe_dump(doc, sort_keys=False)
    if args.write:
        target = Path(str(importlib.resources.files("flexpipe_dag.data").joinpath(EFFICIENCY_FILE)))
        target.write_text("# Generated by `python -m flexpipe_dag.calibration.reference --write`; do not edit by hand.\n" + text)
        print(f"wrote {target}")
    else:
        print(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
