"""The mixed day's figures (reservation curve, offline tokens over the day) and its HTML report.

Plain data in (a :class:`~flexpipe_dag.control.mixed_day.MixedDay`), PNGs and one self-contained HTML
file out, built with the serve report's helpers (:func:`~flexpipe_dag.serving.report.img_tag`,
:func:`~flexpipe_dag.serving.report.html_head`).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

from flexpipe_dag.control.mixed_day import MixedDay, goals
from flexpipe_dag.plots import cumulative_tokens_plot, reservation_curve_plot
from flexpipe_dag.serving.report import html_head, img_tag


def mixed_day_figures(day: MixedDay, title: str = "") -> dict[str, bytes]:
    """``{"reservation_curve": PNG, "offline_tokens": PNG}``: devices online holds per hour of the day per
    policy, and offline tokens completed over the day per policy (cumulative)."""
    suffix = f" ({title})" if title else ""
    curves = {k: p.curve for k, p in day.policies.items()}
    tokens = {k: ([c.t_s for c in p.offline.completions], [c.tokens for c in p.offline.completions])
              for k, p in day.policies.items()}
    return {
        "reservation_curve": reservation_curve_plot(curves, day.fleet_devices, f"online reservation per hour{suffix}"),
        "offline_tokens": cumulative_tokens_plot(tokens, day.duration_s, f"offline tokens over the day{suffix}"),
    }


def write_mixed_day_report(path: str | Path, title: str, day: MixedDay, notes: Sequence[str] = ()) -> Path:
    """Write the mixed day's self-contained HTML report (figures embedded); returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figures = mixed_day_figures(day)
    hours = day.duration_s / 3600.0
    rows = "".join(
        f"<tr><td>{k}</td><td>{p.attainment:.4f}</td><td>{p.online_lost}</td><td>{p.mean_devices:.2f}</td>"
        f"<td>{day.share_of_static(k):.1%}</td><td>{p.offline.tokens:,}</td><td>{p.offline.shared_tokens:,}</td>"
        f"<td>{day.offline_vs_static(k):.2f}x</td>"
        f"<td>{len(p.offline.completions):,}</td><td>{p.offline.preempted}</td><td>{p.offline.lost}</td>"
        f"<td>{p.offline.duplicated}</td><td>{p.shifts / hours:.2f}</td></tr>" for k, p in day.policies.items())
    goal_rows = "".join(f"<tr><td>{html.escape(g.name)}</td><td>{g.value:.4g}</td><td>{html.escape(g.bar)}</td>"
                        f"<td>{'met' if g.met else 'NOT met'}</td></tr>" for g in goals(day))
    doc = f"""{html_head(title)}
<p>{day.fleet_devices} devices; a day of {day.duration_s:.0f} s on the replay's clock; static gear {html.escape(day.static_gear_id)}.</p>
<table><tr><th>policy</th><th>online SLO attainment</th><th>online lost</th><th>mean devices online</th>
<th>reservation vs static</th><th>offline tokens</th><th>of which shared</th><th>vs static</th><th>offline jobs</th><th>preempted</th>
<th>offline lost</th><th>duplicated</th><th>shifts / h</th></tr>{rows}</table>
<h2>Goal (dynamic vs static)</h2><table><tr><th>figure</th><th>value</th><th>bar</th><th></th></tr>{goal_rows}</table>
{img_tag(figures['reservation_curve'], 'reservation curve')}
{img_tag(figures['offline_tokens'], 'offline tokens over the day')}
<h2>Offline instances</h2><ul>{''.join(f'<li>{html.escape(n)}</li>' for n in day.offline_instances)}</ul>
<h2>Notes</h2><ul>{''.join(f'<li>{html.escape(n)}</li>' for n in notes)}
{''.join(f'<li>{k}: {html.escape(n)}</li>' for k, p in day.policies.items() for n in p.notes)}</ul></body></html>"""
    path.write_text(doc, encoding="utf-8")
    return path
