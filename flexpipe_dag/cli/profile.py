"""``flexpipe profile``: validate a declared cluster profile and/or measure this host, store it, print it."""

from __future__ import annotations

import argparse
import json
import sys

from flexpipe_dag.core.errors import InputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="validate / measure a cluster profile, store it and print it",
                       description=__doc__.replace("``", ""))
    p.add_argument("--cluster", metavar="FILE", help="declared inventory (native, seed or fleet YAML/JSON)")
    p.add_argument("--probe", action="store_true", help="measure this host's devices (GPUs, or CPU workers)")
    p.add_argument("--cpu-workers", type=int, default=2, help="CPU worker processes to measure without GPUs")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument("--no-store", action="store_true", help="validate and print only; write nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from flexpipe_dag.profiling.source import build_profile

    if not args.cluster and not args.probe:
        raise InputError(None, "--cluster/--probe", "give a cluster file, --probe, or both")
    if args.cpu_workers < 1:
        raise InputError(None, "--cpu-workers", f"expected >= 1, got {args.cpu_workers}")
    profile = build_profile(probe=args.probe, cluster_file=args.cluster or "", num_cpu_workers=args.cpu_workers)
    version = None
    if not args.no_store:
        from flexpipe_dag.sql.store import Store

        version = Store.from_url().save_profile(profile)
    if args.json:
        json.dump(profile.to_dict(), sys.stdout, indent=2)  # the native form: loads back with --cluster
        print()
        if version is not None:
            print(f"stored {profile.cluster_id} as profile version {version.version} (id {version.id})", file=sys.stderr)
        return 0
    _print_table(profile, version)
    return 0


def _print_table(profile, version) -> None:
    from flexpipe_dag.cli.tables import cli_console, format_number, new_table
    from flexpipe_dag.profiling.summary import device_table

    console = cli_console()
    title = f"{profile.cluster_id} ({profile.source})"
    if version is not None:
        title += f" stored as version {version.version}"
    frame = device_table(profile)
    numeric = [col for col in frame.columns if frame[col].dtype.kind in "fi"]
    table = new_table(title, list(frame.columns), ids=["device"] if "device" in frame.columns else [],
                      text=[col for col in frame.columns if col not in numeric and col != "device"])
    for row in frame.itertuples(index=False):
        table.add_row(*[format_number(v, 2) if isinstance(v, float) or v is None else str(v) for v in row])
    console.print(table)
    if profile.topology is not None:
        t = profile.topology
        racks = len({h.rack_id for h in t.hosts})
        console.print(f"topology: {len(t.hosts)} hosts in {racks} rack(s); between hosts of a rack "
                      f"{t.inter_node.effective_bandwidth_gbps:.3g} GB/s {t.inter_node.latency_us:.3g} us"
                      + (f"; across racks {t.inter_rack.effective_bandwidth_gbps:.3g} GB/s {t.inter_rack.latency_us:.3g} us"
                         f" (oversubscription {t.inter_rack.oversubscription:g})" if t.inter_rack else ""),
                      markup=False)
    shown = [f"{link.src_device_id}->{link.dst_device_id} {link.bandwidth_gbps:.3g} GB/s {link.latency_us:.3g} us"
             for link in profile.links[:6]] + (["..."] if len(profile.links) > 6 else [])
    console.print("; ".join([f"{len(profile.links)} {'override ' if profile.topology is not None else ''}links",
                             *shown]), markup=False)
    for note in profile.notes:
        console.print(f"note: {note}", markup=False)
