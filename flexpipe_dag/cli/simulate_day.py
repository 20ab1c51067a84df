"""``flexpipe simulate --day``: a day of online tide plus an offline backlog on a fleet, three policies.

``--cluster FILE --model MODEL --day [--start-day D] [--duration-s S] [--offline FILE] [--report HTML]``:
the Azure conversation trace shaped by day ``D`` of the ServeGen tide, compressed into ``S`` simulated
seconds, its peak at ``--peak-share`` of the largest gear envelope; the offline backlog is ``--offline``
(default the bundled arXiv summarisation lengths, repeated without end unless ``--offline-once``).
Policies (:mod:`flexpipe_dag.control.mixed_day`): static (the peak gear all day, offline on the rest),
dynamic (the gear-shift controller; offline on the devices each gear frees) and oracle (per window
the cheapest gear holding the load, free shifts: the bound). Printed per policy: online SLO
attainment and lost, mean devices online holds and its share of static's, offline tokens and jobs
(lost, duplicated), shifts per hour; the reservation curve per hour of the day; the goal lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.settings import INT32_MAX, check_number
from flexpipe_dag.core.user_files import check_output_file

#: ``--peak-share`` when neither it nor ``--peak-rps`` is given.
DEFAULT_PEAK_SHARE = 0.95

#: The offline backlog when ``--offline`` is not given.
DEFAULT_BACKLOG = "arxiv-summarization"
#: ``flexpipe simulate`` flags (argparse dests) of the single-gear replay that ``--day`` refuses rather than
#: ignores; each defaults to ``None`` (``False`` for ``--truncate-context``), so any value given is caught.
SINGLE_GEAR_FLAGS = ("gear", "gear_file", "timing", "trace", "window_s", "tide_compression", "speedup",
                     "timeseries_csv", "micro_batch_size", "max_inflight", "kv_capacity_tokens",
                     "chunked_prefill_tokens", "max_context_tokens", "truncate_context")


def add_day_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--day`` flags of ``flexpipe simulate`` (``--cluster``, ``--model``, ``--dtype``, the SLOs,
    ``--offline`` and ``--offline-limit`` are shared with the single-gear replay)."""
    g = p.add_argument_group("mixed day (--day)")
    g.add_argument("--day", action="store_true",
                   help="mixed-day simulation: online tide + offline backlog, static / dynamic / oracle policies")
    g.add_argument("--start-day", type=int, default=0, help="day of the 14-day ServeGen tide (default 0)")
    g.add_argument("--duration-s", type=float, default=7200.0,
                   help="simulated seconds the day is compressed into (default 7200: a day in 2 h)")
    g.add_argument("--peak-share", type=float, default=None,
                   help=f"the tide's peak = this x the largest gear envelope (default {DEFAULT_PEAK_SHARE}; up to 1.5 "
                        "for an overloaded day)")
    g.add_argument("--peak-rps", type=float, default=None,
                   help="the tide's peak, req/s (default: --peak-share x the largest gear envelope)")
    g.add_argument("--gears-from", choices=("sim", "planner"), default="sim",
                   help="sim: operating gears chosen by simulation from the planner's shortlist (minutes on a big "
                        "fleet); planner: the planner's analytic picks, envelopes simulated")
    g.add_argument("--oracle-window-s", type=float, default=600.0, help="the oracle's window, s (default 600)")
    g.add_argument("--offline-once", action="store_true",
                   help="serve the offline backlog once (default: repeat it, a backlog that outlasts the day)")
    g.add_argument("--load-gbps", type=float, default=None,
                   help="host-to-device weight load bandwidth of a new offline instance, GB/s (default 10)")
    g.add_argument("--report", metavar="HTML", help="write the HTML report (reservation curve, offline tokens) here")


def check_day_flags(args: argparse.Namespace) -> None:
    """Refuse bad ``--day`` flags before anything is planned or simulated (the flag is named).

    Raises:
        InputError: missing ``--cluster`` / ``--model``; a single-gear flag given with ``--day``; a number
            out of range.
    """
    for flag in ("cluster", "model"):
        if not getattr(args, flag):
            raise InputError(None, f"--{flag}", "--day needs --cluster FILE and --model MODEL")
    for flag in SINGLE_GEAR_FLAGS:  # given at all (``--micro-batch-size 0`` too), not merely truthy
        value = getattr(args, flag, None)
        if value is not None and value is not False:  # identity: 0 == False would let a 0 through
            raise InputError(None, f"--{flag.replace('_', '-')}", "is for a single-gear replay; --day shapes its own "
                                                                  "online day from the tide and picks its gears")
    check_number(args.duration_s, None, "--duration-s", gt=0, le=86400.0, unit="simulated seconds")
    if args.peak_share is not None and args.peak_rps is not None:
        raise InputError(None, "--peak-share", "give --peak-rps R or --peak-share S (the tide's peak), not both")
    if args.peak_share is None:
        args.peak_share = DEFAULT_PEAK_SHARE
    check_number(args.peak_share, None, "--peak-share", gt=0, le=1.5, unit="share of the largest envelope")
    check_number(args.oracle_window_s, None, "--oracle-window-s", gt=0, unit="seconds")
    check_number(args.start_day, None, "--start-day", integer=True, ge=0, le=13, unit="tide day")
    if args.peak_rps is not None:
        check_number(args.peak_rps, None, "--peak-rps", gt=0, unit="req/s")
    if args.load_gbps is not None:
        check_number(args.load_gbps, None, "--load-gbps", gt=0, unit="GB/s")
    if args.offline_limit is not None:
        check_number(args.offline_limit, None, "--offline-limit", integer=True, ge=1, le=INT32_MAX, unit="jobs")
    from flexpipe_dag.planner.operating import MAX_SLO_MS

    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        if value is not None:
            check_number(value, None, flag, gt=0, le=MAX_SLO_MS, unit="ms")
    if args.report:  # before hours of simulation, not after
        check_output_file(args.report, "--report", "an HTML file path")


def day_lines(day) -> list[str]:
    """The human report of a :class:`~flexpipe_dag.control.mixed_day.MixedDay`, one line each."""
    from flexpipe_dag.control.mixed_day import goals

    hours = day.duration_s / 3600.0
    lines = [f"fleet {day.fleet_devices} devices; day compressed into {day.duration_s:.0f} s; static gear "
             f"{day.static_gear_id}"]
    for k, p in day.policies.items():
        lines.append(f"{k:8s}: online SLO attainment {p.attainment:.4f}, lost {p.online_lost}; mean devices online "
                     f"{p.mean_devices:.2f} ({day.share_of_static(k):.1%} of static); offline {p.offline.tokens:,} tokens "
                     f"({day.offline_vs_static(k):.2f}x static; {p.offline.shared_tokens:,} in the online gears' "
                     f"spare capacity), {len(p.offline.completions):,} jobs, "
                     f"{p.offline.preempted} preempted, lost {p.offline.lost}, duplicated {p.offline.duplicated}; "
                     f"{p.shifts} shifts = {p.shifts / hours:.2f} per hour")
    for k, p in day.policies.items():
        lines.append(f"reservation curve {k:8s} (devices per hour of the day): " + " ".join(f"{v:.1f}" for v in p.curve))
    for g in goals(day):
        lines.append(f"goal {g.name}: {g.value:.4g} ({g.bar}): {'met' if g.met else 'NOT met'}")
    for note in day.offline_instances:
        lines.append(f"offline instance on {note}")
    return lines


def run_day(args: argparse.Namespace) -> int:
    """Run ``flexpipe simulate --day`` (module docstring)."""
    check_day_flags(args)
    from flexpipe_dag.control import Controller
    from flexpipe_dag.control.day_setting import day_setting, leave_one_out_forecast, operating_gears
    from flexpipe_dag.control.mixed_day import mixed_day_controller_config, run_mixed_day
    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.sim import SimConfig
    from flexpipe_dag.workload import Workload, load_trace

    if os.environ.get("FLEXPIPE_CONTROL_FILE"):  # the serving loop's figures; the mixed day keeps its own
        print(f"note: FLEXPIPE_CONTROL_FILE ({os.environ['FLEXPIPE_CONTROL_FILE']}) is not read by simulate --day: "
              "its dynamic policy runs the mixed day's own controller figures (MIXED_DAY_CONTROLLER), the same in "
              "every run, so its figures compare with bench/mixed_day.py's", file=sys.stderr)
    dtype = args.dtype or "bf16"
    slo_ttft_ms = args.slo_ttft_ms or SimConfig.slo_ttft_ms
    slo_tpot_ms = args.slo_tpot_ms or SimConfig.slo_tpot_ms
    cluster = load_cluster_profile(args.cluster)
    spec = load_model_spec(args.model)
    backlog = load_trace(args.offline or DEFAULT_BACKLOG)
    if args.offline_limit is not None:
        backlog = Workload(backlog.name, backlog.requests[: args.offline_limit], backlog.source, backlog.meta)
    gears = operating_gears(cluster, spec, dtype=dtype, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                            source=args.gears_from)
    setting = day_setting(cluster, spec, dtype, gears, start_day=args.start_day, duration_s=args.duration_s,
                          slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, peak_share=args.peak_share,
                          peak_rps=args.peak_rps, window_s=args.oracle_window_s)
    day = run_mixed_day(setting, Controller(mixed_day_controller_config(slo_ttft_ms)), backlog,
                        cycle_backlog=not args.offline_once,
                        forecast=leave_one_out_forecast(args.start_day, args.duration_s), load_gbps=args.load_gbps)
    if args.report:
        from flexpipe_dag.serving.mixed_day_report import write_mixed_day_report

        write_mixed_day_report(args.report, f"mixed day: {spec.name} on {cluster.cluster_id}, tide day {args.start_day}",
                               day, notes=gears.notes)
    if args.json:
        print(json.dumps({"model": spec.name, "cluster": cluster.cluster_id, "start_day": args.start_day,
                          "gears": [g.gear_id for g in gears.gears], **day.to_dict()}, indent=2))
    else:
        print(f"model {spec.name} ({dtype}) on {cluster.cluster_id}; online {len(setting.workload)} requests "
              f"(tide day {args.start_day}); offline backlog {args.offline or DEFAULT_BACKLOG} "
              f"({len(backlog)} jobs{'' if args.offline_once else ', repeated'})")
        for g in gears.gears:
            print(f"gear {g.gear_id}: {len(g.device_ids)} devices, envelope {g.rps_min:.2f}-{g.rps_max:.2f} req/s")
        for line in day_lines(day):
            print(line)
        if args.report:
            print(f"report: {args.report}")
    return 0
