"""Score gears on a reference workload: what the planner's envelopes and the ``gear_evaluations`` asset use.

:func:`evaluate_gear` simulates one gear and condenses the result into a
:class:`~flexpipe_dag.core.gear.GearEstimate` plus a latency CDF; :func:`plot_evaluation` draws the
CDF and the per-stage utilisation over time (matplotlib, imported lazily).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flexpipe_dag.core.gear import Gear, GearEstimate
from flexpipe_dag.core.timing import StageTimingModel
from flexpipe_dag.sim.config import SimConfig
from flexpipe_dag.sim.engine import Simulator
from flexpipe_dag.sim.results import SimResult
from flexpipe_dag.workload.request import Workload

CDF_QUANTILES = tuple(np.round(np.linspace(0.0, 1.0, 101), 2))


@dataclass
class GearEvaluation:
    """One gear on one workload: its estimate, latency CDFs (ms at :data:`CDF_QUANTILES`) and the full result."""

    gear_id: str
    workload: str
    estimate: GearEstimate
    ttft_cdf_ms: list[float]
    e2e_cdf_ms: list[float]
    result: SimResult

    def to_dict(self) -> dict[str, Any]:
        return {"gear_id": self.gear_id, "workload": self.workload, "estimate": self.estimate.model_dump(),
                "ttft_cdf_ms": self.ttft_cdf_ms, "e2e_cdf_ms": self.e2e_cdf_ms, "summary": self.result.summary}


def estimate_from_result(result: SimResult) -> GearEstimate:
    """A :class:`GearEstimate` from a simulation (bottleneck = the most utilised stage of the first gear)."""
    s = result.summary
    util = s["stage_utilisation"][s["gear_id"]]

    def v(d: Mapping[str, Any], k: str) -> float:
        return float(d[k]) if d[k] is not None else 0.0

    return GearEstimate(
        throughput_rps=s["throughput_rps"], tokens_per_s=s["tokens_per_s"],
        ttft_p50_ms=v(s["ttft_ms"], "p50"), ttft_p99_ms=v(s["ttft_ms"], "p99"),
        tpot_p50_ms=v(s["tpot_ms"], "p50"), tpot_p99_ms=v(s["tpot_ms"], "p99"),
        bottleneck_stage=int(np.argmax(util)) if util else 0,
    )


def _cdf(values: np.ndarray) -> list[float]:
    v = values[~np.isnan(values)]
    return [float(x) for x in np.quantile(v, CDF_QUANTILES)] if v.size else []


def evaluate_gear(gear: Gear, timing: StageTimingModel, workload: Workload, config: SimConfig | None = None) -> GearEvaluation:
    """Simulate ``workload`` on ``gear`` and summarise it (see module docstring)."""
    return evaluation_from_result(gear.gear_id, workload.name, Simulator(workload, gear, timing, config).run())


def evaluation_from_result(gear_id: str, workload_name: str, result: SimResult) -> GearEvaluation:
    """A :class:`GearEvaluation` of a finished simulation of ``gear_id`` on ``workload_name``."""
    df = result.requests
    return GearEvaluation(gear_id, workload_name, estimate_from_result(result),
                          _cdf(df["ttft_ms"].to_numpy()), _cdf(df["e2e_ms"].to_numpy()), result)


def plot_evaluation(evaluations: list[GearEvaluation], path: str | Path) -> Path:
    """PNG with the TTFT CDF of each gear (left) and each gear's per-stage busy fraction over time (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cdf, ax_util) = plt.subplots(1, 2, figsize=(11, 4))
    for ev in evaluations:
        if ev.ttft_cdf_ms:
            ax_cdf.plot(ev.ttft_cdf_ms, CDF_QUANTILES, label=ev.gear_id)
        ts = ev.result.timeseries()
        for col in [c for c in ts.columns if c.endswith("_busy")]:
            ax_util.plot(ts["t_s"], ts[col].rolling(15, min_periods=1).mean(), label=f"{ev.gear_id} {col[:-5]}", lw=0.8)
    ax_cdf.set(xscale="log", xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    ax_util.set(xlabel="simulated time (s)", ylabel="busy fraction (30 s mean)", ylim=(0, 1.05), title="stage utilisation")
    ax_cdf.legend(fontsize=7)
    ax_util.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
