"""The serve run's summary and its HTML report (load vs gear over time, stage utilisation, latency CDF).

Inputs are plain data: metric samples (the live runtime's 2-second schema), per-request results
(``klass``, ``ttft_ms``, ``tpot_ms``, ``e2e_ms``, ``output_tokens``), shift records (``t_s``,
``from_gear``, ``to_gear``, ``trigger``, ``status``, ``reason``) and declined decisions (``t_s``,
``from_gear``, ``to_gear``, ``trigger``, ``kind``, ``reason``; the controller declines again at every
evaluation while the cause lasts, so the report folds a run of alike declines into one episode, see
:func:`decline_episodes`). Figures are PNGs embedded in one self-contained HTML file.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flexpipe_dag.core.metrics import MetricSample
from flexpipe_dag.plots import to_png


def _pct(values: Sequence[float | None], q: float) -> float | None:
    v = np.array([x for x in values if x is not None], dtype=float)
    return float(np.percentile(v, q)) if v.size else None


def decline_episodes(declines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive declines of the same kind from the same gear folded into one episode each.

    The situation an operator acts on is the kind (dwell, payback, no gear holds the load, no
    candidate) on the serving gear; the triggers that fired during it (the load above the envelope,
    then latency well under the SLO, ...) are listed, not split into episodes of their own.

    Returns:
        ``{"first_t_s", "last_t_s", "count", "from_gear", "to_gear", "triggers", "kind", "reason"}`` per
        episode, in time order; ``triggers`` the distinct triggers in the order they fired, joined by ", ";
        ``to_gear`` and ``reason`` are the episode's last (its figures are the newest).
    """
    episodes: list[dict[str, Any]] = []
    for d in sorted(declines, key=lambda x: x["t_s"]):
        key = (d.get("from_gear"), d.get("kind"))
        last = episodes[-1] if episodes else None
        if last is not None and (last["from_gear"], last["kind"]) == key:
            seen = [t for t in last["triggers"].split(", ") if t]
            if d.get("trigger") and d["trigger"] not in seen:
                last["triggers"] = ", ".join([*seen, d["trigger"]])
            last.update(last_t_s=d["t_s"], count=last["count"] + 1, to_gear=d.get("to_gear"), reason=d["reason"])
        else:
            episodes.append({"first_t_s": d["t_s"], "last_t_s": d["t_s"], "count": 1, "from_gear": key[0],
                             "to_gear": d.get("to_gear"), "triggers": d.get("trigger") or "", "kind": key[1],
                             "reason": d["reason"]})
    return episodes


def summarize(results: Sequence[dict[str, Any]], submitted: int, elapsed_s: float,
              shifts: Sequence[dict[str, Any]], declines: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Requests served / lost, output tokens/s and TTFT / TPOT P50 / P99 per class, the shifts and the declines.

    ``lost`` = submitted requests without exactly one result; ``duplicates`` = extra results for an id;
    ``declines`` = :func:`decline_episodes` of the declined decisions.
    """
    ids = [r["id"] for r in results]
    unique = set(ids)
    out: dict[str, Any] = {"submitted": submitted, "served": len(unique), "lost": submitted - len(unique),
                           "duplicates": len(ids) - len(unique), "elapsed_s": round(elapsed_s, 1),
                           "output_tokens_per_s": round(sum(r["output_tokens"] for r in results) / elapsed_s, 2)
                           if elapsed_s > 0 else 0.0, "shifts": list(shifts),
                           "declines": decline_episodes(declines), "by_class": {}}
    for klass in sorted({r.get("klass", "online") for r in results}):
        rs = [r for r in results if r.get("klass", "online") == klass]
        out["by_class"][klass] = {
            "served": len(rs),
            **{f"{m}_p{q}_ms": (round(v, 1) if (v := _pct([r.get(f"{m}_ms") for r in rs], q)) is not None else None)
               for m in ("ttft", "tpot", "e2e") for q in (50, 99)},
        }
    return out


def _segments(samples: Sequence[MetricSample]) -> list[tuple[float, float, str]]:
    segs: list[tuple[float, float, str]] = []
    for s in samples:
        if segs and segs[-1][2] == s.gear_id:
            segs[-1] = (segs[-1][0], s.t_s, s.gear_id)
        else:
            segs.append((segs[-1][1] if segs else 0.0, s.t_s, s.gear_id))
    return segs


def load_vs_gear_png(samples: Sequence[MetricSample], shifts: Sequence[dict[str, Any]]) -> bytes:
    """Offered request rate and output tokens/s over time, the serving gear shaded, each shift marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 3.6), dpi=100)
    t = [s.t_s for s in samples]
    (raw,) = ax.plot(t, [s.rps for s in samples], label="online arrivals (req/s)", color="k", lw=0.6, alpha=0.5)
    smoothed, level = [], None
    for s in samples:  # the EMA the controller acts on (design seed alpha 0.3)
        level = s.rps if level is None else 0.3 * s.rps + 0.7 * level
        smoothed.append(level)
    (ema,) = ax.plot(t, smoothed, label="online arrivals, EMA (req/s)", color="k", lw=1.8)
    ax2 = ax.twinx()
    ax2.plot(t, [s.tokens_per_s for s in samples], label="output tokens/s", color="tab:green", alpha=0.6)
    ax2.set_ylabel("output tokens/s")
    gears = sorted({s.gear_id for s in samples})
    pastel = matplotlib.colormaps["Pastel1"]  # 9 listed colours, repeated past the ninth gear
    colors = {g: pastel(i % pastel.N) for i, g in enumerate(gears)}
    for a, b, g in _segments(samples):
        ax.axvspan(a, b, color=colors[g], alpha=0.6, lw=0)
    for sh in shifts:
        ax.axvline(sh["t_s"], color="tab:red", ls="--", lw=1)
        ax.text(sh["t_s"], ax.get_ylim()[1] * 0.95, f" {sh['status']}: {sh['to_gear']}", fontsize=7, color="tab:red",
                va="top")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[g]) for g in gears]
    ax.legend(handles + [raw, ema], gears + [str(raw.get_label()), str(ema.get_label())], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.08, 1.0))
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("req/s")
    ax.set_title("load vs gear", fontsize=10)
    return to_png(fig)


def stage_utilisation_png(samples: Sequence[MetricSample]) -> bytes:
    """Busy fraction of each stage over time (a stage index's meaning changes with the gear)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.0), dpi=100)
    n = max((len(s.stages) for s in samples), default=0)
    for i in range(n):
        pts = [(s.t_s, st.busy_fraction) for s in samples for st in s.stages if st.stage_index == i]
        if pts:
            ax.plot(*zip(*pts), label=f"stage {i}")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("busy fraction")
    ax.set_title("stage utilisation", fontsize=10)
    ax.legend(fontsize=7)
    return to_png(fig)


def latency_cdf_png(results: Sequence[dict[str, Any]]) -> bytes:
    """Empirical CDFs of TTFT and end-to-end latency per request class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), dpi=100)
    for ax, metric in zip(axes, ("ttft_ms", "e2e_ms")):
        for klass in sorted({r.get("klass", "online") for r in results}):
            v = np.sort([r[metric] for r in results if r.get("klass", "online") == klass and r.get(metric) is not None])
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size, label=f"{klass} ({v.size})")
        ax.set_xscale("log")
        ax.set_xlabel(metric.replace("_ms", " (ms)"))
        ax.set_ylabel("fraction of requests")
        ax.legend(fontsize=7)
    fig.suptitle("latency CDF", fontsize=10)
    return to_png(fig)


def img_tag(png: bytes, alt: str) -> str:
    """An ``<img>`` element with the PNG embedded as base64 (the report stays one self-contained file)."""
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def html_head(title: str) -> str:
    """The start of a report page: doctype, style, the title as ``<h1>`` and when it was generated."""
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px}}img{{max-width:100%}}</style></head><body>
<h1>{html.escape(title)}</h1><p>generated {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}</p>"""


def write_html_report(path: str | Path, title: str, summary: dict[str, Any], samples: Sequence[MetricSample],
                      results: Sequence[dict[str, Any]], notes: Sequence[str] = ()) -> Path:
    """Write a self-contained HTML report (figures embedded as base64 PNGs); returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    img = img_tag
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v['served']}</td>"
        + "".join(f"<td>{v.get(f'{m}_p{q}_ms') if v.get(f'{m}_p{q}_ms') is not None else '-'}</td>"
                  for m in ("ttft", "tpot", "e2e") for q in (50, 99)) + "</tr>"
        for k, v in summary["by_class"].items())
    shifts = "".join(
        f"<tr><td>{sh['t_s']:.1f}</td><td>{html.escape(str(sh.get('from_gear')))}</td><td>{html.escape(sh['to_gear'])}</td>"
        f"<td>{html.escape(str(sh.get('trigger')))}</td><td>{html.escape(sh['status'])}</td>"
        f"<td>{html.escape(sh['reason'])}</td></tr>" for sh in summary["shifts"])
    declines = "".join(
        f"<tr><td>{d['first_t_s']:.1f}</td><td>{d['last_t_s']:.1f}</td><td>{d['count']}</td>"
        + "".join(f"<td>{html.escape(str(d.get(k) or '-'))}</td>" for k in ("from_gear", "to_gear", "triggers", "kind"))
        + f"<td>{html.escape(d['reason'])}</td></tr>" for d in summary.get("declines", ()))
    doc = f"""{html_head(title)}
<p><b>{summary['served']}</b> of {summary['submitted']} requests served, <b>lost {summary['lost']}</b>,
duplicates {summary['duplicates']}, {summary['output_tokens_per_s']} output tokens/s over {summary['elapsed_s']} s.</p>
<table><tr><th>class</th><th>served</th><th>TTFT p50</th><th>TTFT p99</th><th>TPOT p50</th><th>TPOT p99</th>
<th>e2e p50</th><th>e2e p99</th></tr>{rows}</table>
<h2>Shifts</h2><table><tr><th>t (s)</th><th>from</th><th>to</th><th>trigger</th><th>status</th><th>reason</th></tr>{shifts}</table>
<h2>Declined shifts</h2><p>{len(summary.get('declines', ()))} episode(s): a trigger fired and the controller held;
each row folds consecutive declines of one kind (dwell, payback, no_gear_holds, no_candidate) on one gear, lists the triggers
that fired and shows the last reason.</p>
<table><tr><th>first t (s)</th><th>last t (s)</th><th>times</th><th>from</th><th>considered (last)</th><th>triggers</th>
<th>kind</th><th>reason</th></tr>{declines}</table>
{img(load_vs_gear_png(samples, summary['shifts']), 'load vs gear')}
{img(stage_utilisation_png(samples), 'stage utilisation')}
{img(latency_cdf_png(results), 'latency CDF')}
<h2>Notes</h2><ul>{''.join(f'<li>{html.escape(n)}</li>' for n in notes)}</ul></body></html>"""
    path.write_text(doc, encoding="utf-8")
    return path
