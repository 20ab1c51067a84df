"""The mixed day: online tide plus an offline backlog, static vs dynamic shifting vs the per-window oracle.

Usage: python bench/mixed_day.py [--setting openb lab] [--days 0 1 3] [--duration-s 3600]
                                 [--offline arxiv-summarization] [--load-gbps 10] [--report-dir DIR]

For each setting (``bench/shift_bench.py``'s: ``openb`` = Llama-2-7B on the Alibaba openb slice, SLO
2.5 s / 200 ms; ``lab`` = Llama-3-8B on the fragmented lab, 2 s / 200 ms) the operating gears are
chosen once by simulation (:func:`flexpipe_dag.control.day_setting.operating_gears`, as shift_bench
does), then each day of the ServeGen tide (``--days``, default 0 1 3) is replayed, compressed into
``--duration-s`` simulated seconds (default 3600: a day in an hour, to keep the run to minutes), its
peak at 0.95 of the largest envelope, with the arXiv summarisation backlog (repeated: it outlasts the
day) on the devices online does not hold and, in the dynamic and oracle policies, in the serving
gear's spare capacity in troughs (``--no-share``: not). Policies and the offline model:
:mod:`flexpipe_dag.control.mixed_day`, :mod:`flexpipe_dag.control.offline_fill` and
:mod:`flexpipe_dag.control.offline_share` (README, "The mixed day").

Goal (issue 18), dynamic against static and at online SLO attainment no lower than static's: mean
online reservation <= 45 % of static's, offline tokens per day >= 1.5x static's, <= 4 shifts per
hour (of the replay's clock, as shift_bench counts them), 0 lost or duplicated. The oracle is
printed as the bound. Each goal line says met or NOT met. The controller keeps the tide replay's
figures (:data:`~flexpipe_dag.control.replay.REPLAY_CONTROLLER`) plus
:data:`~flexpipe_dag.control.mixed_day.MIXED_DAY_CONTROLLER`, and the sharing figures
(:data:`~flexpipe_dag.control.mixed_day.DEFAULT_SHARE`); these were chosen by looking at dynamic
replays of openb days 0, 1, 3 and lab day 0 (the headrooms, the 300 s forecast, 1/16 of the seats, the
guard), so the figures below are not held-out ones.

Cases (setting, day) run in ``--jobs`` processes (default 2); the figures do not depend on it.

Measured 2026-12-03 (after the step-pricing fix and overload_dwell_s; deterministic), dynamic
reservation share of static / offline multiple of static / attainment vs static's / shifts per hour,
the oracle's share and multiple in brackets: openb (gears on 3 / 4 / 8 devices) day 0 59.7 % / 1.86x /
0.9988 vs 0.9989 / 3 (41.7 %, 2.07x); day 1 58.2 % / 1.82x / 0.9986 vs 0.9988 / 2 (41.7 %, 2.05x);
day 3 88.3 % / 1.21x / 0.9350 vs 0.9203 / 2 (70.8 %, 1.49x); lab day 0 80.7 % / 1.36x / 0.9999 vs
1.0000 / 3 (75.0 %, 1.46x); day 1 81.2 % / 1.40x / 1.0000 vs 1.0000 / 1 (75.0 %, 1.48x); day 3 98.0 % /
1.03x / 0.9923 vs 0.9923 / 1 (91.7 %, 1.15x). Lost and duplicated 0 everywhere; the goal is met on no
case (README, "The mixed day", says why for each). The whole default run took 225 s wall (gear
selection 61 s openb, 16 s lab).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from shift_bench import SETTINGS  # the same named settings (bench/ is on sys.path when run as a script)

from flexpipe_dag.control import Controller
from flexpipe_dag.control.day_setting import OperatingGears, day_setting, leave_one_out_forecast, operating_gears
from flexpipe_dag.control.mixed_day import DEFAULT_SHARE, goals, mixed_day_controller_config, run_mixed_day
from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.workload import load_trace

ROOT = Path(__file__).resolve().parents[1]


def run_case(name: str, day: int, gears: OperatingGears, args: argparse.Namespace) -> tuple[list[str], bool]:
    """One setting and tide day: the three policies' figures and goal lines, and whether every goal is met."""
    s = SETTINGS[name]
    cluster = load_cluster_profile(ROOT / s["cluster"])
    spec = ModelSpec.from_builtin(s["model"])
    t0 = time.perf_counter()
    setting = day_setting(cluster, spec, "bf16", gears, start_day=day, duration_s=args.duration_s,
                          slo_ttft_ms=s["slo_ttft_ms"], slo_tpot_ms=s["slo_tpot_ms"], peak_share=s["peak_share"])
    md = run_mixed_day(setting, Controller(mixed_day_controller_config(s["slo_ttft_ms"])), load_trace(args.offline),
                       forecast=leave_one_out_forecast(day, args.duration_s), load_gbps=args.load_gbps,
                       share=None if args.no_share else DEFAULT_SHARE)
    hours = md.duration_s / 3600.0
    out = [f"-- {name} day {day}: {len(setting.workload)} online requests over {args.duration_s:.0f} s; "
           f"static gear {md.static_gear_id} [{time.perf_counter() - t0:.0f} s wall]"]
    for k, p in md.policies.items():
        out.append(f"   {k:8s} SLO {p.attainment:.4f} ({p.online_requests - p.online_slo_met:.0f} missed)  lost "
                   f"{p.online_lost}  mean devices online {p.mean_devices:5.2f} ({md.share_of_static(k):6.1%} of "
                   f"static)  offline {p.offline.tokens / 1e6:8.2f} M tokens ({md.offline_vs_static(k):5.2f}x; "
                   f"{p.offline.shared_tokens / 1e6:.2f} M shared), {len(p.offline.completions)} jobs, "
                   f"{p.offline.preempted} preempted, lost {p.offline.lost}, dup {p.offline.duplicated}  shifts/h "
                   f"{p.shifts / hours:.2f}")
        out.append(f"   {'':8s} reservation per hour: " + " ".join(f"{v:.1f}" for v in p.curve))
    out += [f"   offline instance on {line}" for line in md.offline_instances]
    gl = goals(md)
    out += [f"   goal {g.name}: {g.value:.4g} ({g.bar}): {'met' if g.met else 'NOT met'}" for g in gl]
    out.append("   bound (oracle): " + "; ".join(f"{g.name} {g.value:.4g}" for g in goals(md, "oracle")))
    ok = all(g.met for g in gl)
    out.append(f"   goal (all of the above) {name} day {day}: {'met' if ok else 'NOT met'}")
    if args.report_dir:
        from flexpipe_dag.serving.mixed_day_report import write_mixed_day_report

        path = write_mixed_day_report(Path(args.report_dir) / f"mixed_day_{name}_day{day}.html",
                                      f"mixed day: {name}, tide day {day}", md, notes=gears.notes)
        out.append(f"   report {path}")
    return out, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", nargs="+", choices=sorted(SETTINGS), default=["openb", "lab"])
    ap.add_argument("--days", nargs="+", type=int, default=[0, 1, 3], help="days of the ServeGen tide")
    ap.add_argument("--duration-s", type=float, default=3600.0, help="simulated seconds a day is compressed into")
    ap.add_argument("--offline", default="arxiv-summarization", help="offline backlog (file or bundled name)")
    ap.add_argument("--load-gbps", type=float, default=None, help="offline instance weight load bandwidth, GB/s")
    ap.add_argument("--report-dir", help="write one HTML report per setting and day here")
    ap.add_argument("--no-share", action="store_true",
                    help="offline only on the devices online does not hold (the model before offline sharing)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="cases (setting, day) simulated at once, one process each (default: 2, or 1 on one core); "
                         "the figures do not depend on it")
    args = ap.parse_args(argv)
    if not args.duration_s > 0:
        ap.error(f"--duration-s: expected seconds > 0, got {args.duration_s}")
    if args.jobs < 1:
        ap.error(f"--jobs: expected >= 1, got {args.jobs}")
    t_all = time.perf_counter()
    cases = []
    for name in args.setting:
        s = SETTINGS[name]
        cluster = load_cluster_profile(ROOT / s["cluster"])
        spec = ModelSpec.from_builtin(s["model"])
        t0 = time.perf_counter()
        gears = operating_gears(cluster, spec, dtype="bf16", slo_ttft_ms=s["slo_ttft_ms"], slo_tpot_ms=s["slo_tpot_ms"])
        print(f"== {name}: {spec.name} on {cluster.cluster_id} ({len(cluster.devices)} devices), SLO TTFT "
              f"{s['slo_ttft_ms']:.0f} ms / TPOT {s['slo_tpot_ms']:.0f} ms; gears chosen in "
              f"{time.perf_counter() - t0:.0f} s wall:")
        for g in gears.gears:
            print(f"   {g.gear_id:26s} {len(g.device_ids):2d} devices, envelope {g.rps_min:.2f}-{g.rps_max:.2f} req/s")
        cases += [(name, day, gears) for day in args.days]
    verdicts = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:  # cases are independent: same figures in any order
        futures = [pool.submit(run_case, name, day, gears, args) for name, day, gears in cases]
        for (name, day, _), fut in zip(cases, futures):
            lines, ok = fut.result()
            print("\n".join(lines), flush=True)
            verdicts.append((name, day, ok))
    print("summary: " + ", ".join(f"{n} day {d} {'met' if ok else 'NOT met'}" for n, d, ok in verdicts))
    print(f"total wall {time.perf_counter() - t_all:.0f} s ({args.jobs} process(es))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
