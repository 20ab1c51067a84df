"""Plots FlexPipe shows users (Dagster metadata, HTML reports), rendered to PNG bytes with matplotlib."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence


def _figure(width_in: float = 6.0, height_in: float = 4.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width_in, height_in), dpi=100)


def to_png(fig) -> bytes:
    """Render and close a matplotlib figure; returns PNG bytes."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def link_bandwidth_heatmap(device_ids: Sequence[str], bandwidth_gbps: Sequence[Sequence[float | None]],
                           title: str) -> bytes:
    """Heatmap of directed link bandwidth (GB/s), row = source, column = destination; None = no link."""
    import numpy as np

    n = len(device_ids)
    grid = np.array([[np.nan if v is None else v for v in row] for row in bandwidth_gbps], dtype=float)
    fig, ax = _figure(1.5 + 0.55 * n, 1.2 + 0.5 * n)
    im = ax.imshow(np.log10(grid), cmap="viridis")
    ax.set_xticks(range(n), device_ids, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(n), device_ids, fontsize=7)
    for i in range(n):
        for j in range(n):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", fontsize=6, color="w")
    fig.colorbar(im, ax=ax, label="log10 GB/s")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("destination")
    ax.set_ylabel("source")
    return to_png(fig)


def gear_layout_plot(gears: Sequence) -> bytes:
    """Left: layers per device for each gear (one bar per gear, one segment per stage, labelled with its
    devices). Right: each stage's estimated time per micro-batch step, ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_t) = plt.subplots(1, 2, figsize=(12.0, 1.5 + 0.8 * len(gears)), dpi=100)
    colors = matplotlib.colormaps["tab10"]  # 10 listed colours; an int picks one
    for row, gear in enumerate(gears):
        for st in gear.stages:
            ax_l.barh(row, st.num_layers, left=st.layer_start, color=colors(st.stage_index % 10), edgecolor="k")
            ax_l.text(st.layer_start + st.num_layers / 2, row, "\n".join(st.device_ids), ha="center",
                      va="center", fontsize=6)
        times = [st.est_stage_ms or 0.0 for st in gear.stages]
        ax_t.plot(range(len(times)), times, marker="o", label=gear.gear_id)
    ax_l.set_yticks(range(len(gears)), [g.gear_id for g in gears], fontsize=7)
    ax_l.set_xlabel("decoder layer")
    ax_l.set_title("layers per stage / device", fontsize=9)
    ax_t.set_xlabel("stage")
    ax_t.set_ylabel("est. ms per micro-batch step")
    ax_t.set_title("estimated stage times", fontsize=9)
    ax_t.legend(fontsize=7)
    return to_png(fig)


def reservation_curve_plot(curves: Mapping[str, Sequence[float]], fleet_devices: int, title: str) -> bytes:
    """Devices online serving holds in each hour of the day (device-hours per hour), one step line per
    policy, with the fleet's size as a dashed line."""
    fig, ax = _figure(8.0, 3.6)
    for name, curve in curves.items():
        hours = list(range(len(curve) + 1))
        ax.step(hours, list(curve) + [curve[-1]] if curve else [], where="post", label=name)
    ax.axhline(fleet_devices, color="k", ls="--", lw=0.8, label=f"fleet ({fleet_devices})")
    ax.set_xlabel("hour of the day")
    ax.set_ylabel("devices held by online")
    ax.set_ylim(0, fleet_devices * 1.08)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return to_png(fig)


def cumulative_tokens_plot(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], day_s: float,
                           title: str) -> bytes:
    """Offline tokens completed over the day, cumulative, one line per policy.

    Args:
        series: per policy, ``(completion times s, tokens of each completion)``.
        day_s: the day's length on that clock, s (the x axis reads hours of the day).
    """
    import numpy as np

    fig, ax = _figure(8.0, 3.6)
    for name, (times_s, tokens) in series.items():
        t = np.concatenate([[0.0], np.asarray(times_s, dtype=float), [day_s]]) * 24.0 / day_s
        total = np.cumsum(np.asarray(tokens, dtype=float))
        y = np.concatenate([[0.0], total, [total[-1] if total.size else 0.0]])
        ax.step(t, y / 1e6, where="post", label=name)
    ax.set_xlabel("hour of the day")
    ax.set_ylabel("offline tokens completed (M)")
    ax.set_xlim(0, 24)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return to_png(fig)
