"""Figures of a calibration: predicted vs measured stage time per device, before and after (PNG bytes).

matplotlib is imported inside the function (Agg backend), so importing this module stays cheap.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

from flexpipe_dag.calibration.calibrate import predicted_step_ms
from flexpipe_dag.calibration.observation import StageObservation
from flexpipe_dag.planner.cost_model import CostModel


def stage_time_errors(before: CostModel, after: CostModel, observations: Sequence[StageObservation]
                      ) -> dict[str, dict[str, float]]:
    """Per device: median |pred - meas| / meas and total predicted / total measured, before and after.

    Returns:
        ``{device_id: {"steps", "median_ape_before", "median_ape_after", "total_ratio_before", "total_ratio_after"}}``.
    """
    obs = list(observations)
    y = np.array([o.wall_ms for o in obs])
    pb, pa = predicted_step_ms(before, obs), predicted_step_ms(after, obs)
    out = {}
    for dev in sorted({o.device_id for o in obs}):
        m = np.array([o.device_id == dev for o in obs])
        out[dev] = {"steps": int(m.sum()),
                    "median_ape_before": float(np.median(np.abs(pb[m] - y[m]) / y[m])),
                    "median_ape_after": float(np.median(np.abs(pa[m] - y[m]) / y[m])),
                    "total_ratio_before": float(pb[m].sum() / y[m].sum()),
                    "total_ratio_after": float(pa[m].sum() / y[m].sum())}
    return out


def plot_predicted_vs_measured(before: CostModel, after: CostModel, observations: Sequence[StageObservation],
                               title: str = "stage time per micro-batch step") -> bytes:
    """PNG: one panel per device, measured (x) vs predicted (y) step time in ms on log axes, the prior
    model's predictions and the calibrated model's, with the ``y = x`` line and a +-15 % band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    obs = list(observations)
    devices = sorted({o.device_id for o in obs})
    y = np.array([o.wall_ms for o in obs])
    pb, pa = predicted_step_ms(before, obs), predicted_step_ms(after, obs)
    fig, axes = plt.subplots(1, max(1, len(devices)), figsize=(4.2 * max(1, len(devices)), 4), squeeze=False)
    for ax, dev in zip(axes[0], devices):
        m = np.array([o.device_id == dev for o in obs])
        lo = min(y[m].min(), pb[m].min(), pa[m].min()) * 0.8
        hi = max(y[m].max(), pb[m].max(), pa[m].max()) * 1.25
        xs = np.array([lo, hi])
        ax.fill_between(xs, xs * 0.85, xs * 1.15, color="0.9", label="+-15 %")
        ax.plot(xs, xs, color="0.4", lw=1)
        ax.scatter(y[m], pb[m], s=10, marker="x", color="tab:red", label="before (profile)")
        ax.scatter(y[m], pa[m], s=10, marker="o", facecolors="none", color="tab:blue", label="after (calibrated)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured, ms")
        ax.set_ylabel("predicted, ms")
        ax.set_title(dev, fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()
