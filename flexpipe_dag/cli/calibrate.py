"""``flexpipe calibrate``: fit the cost model to the stage steps stored from real runs, or report its fidelity.

    flexpipe calibrate [--cluster-id KEY] [--model SmolLM2-135M] [--dtype fp32] [--run-key K ...]
    flexpipe calibrate --report

The fit reads the observed steps in the store (``stage_observations``), refines the newest calibration
of the cluster's newest profile version (or the raw profile) and stores the result as the next
calibration version beside that profile (``--dry-run``: print only). ``--report`` prints, for each gear
that ran, predicted vs measured TTFT / TPOT service time and stage time, before and after calibration.
"""

from __future__ import annotations

import argparse

from flexpipe_dag.core.errors import InputError


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="fit the cost model to observed runs; --report: predicted vs measured",
                              description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--cluster-id", default=None, help="cluster whose runs to use (default: the only one observed)")
    p.add_argument("--model", default="SmolLM2-135M", help="model the runs served (built-in name, config dir, .gguf)")
    p.add_argument("--dtype", default="fp32", help="dtype the runs computed in (fp32 on the CPU runtime)")
    p.add_argument("--run-key", action="append", default=None, help="use only these runs (repeatable)")
    p.add_argument("--group-by", choices=("device", "model"), default="device",
                   help="fit each device, or pool devices of the same model and profile")
    p.add_argument("--report", action="store_true", help="print the fidelity report instead of fitting")
    p.add_argument("--dry-run", action="store_true", help="fit and print, store nothing")
    p.set_defaults(func=run)


def _observations(store, args):
    runs = store.observed_runs()
    if args.run_key:
        runs = [r for r in runs if r["run_key"] in args.run_key]
    clusters = sorted({r["cluster_key"] for r in runs if r["cluster_key"]})
    if not runs:
        raise InputError("store", "stage_observations", "no observed steps stored; run the Dagster batch_inference job (or "
                         "`flexpipe demo`) first: it records every stage step in the store (`flexpipe run` "
                         "writes its results to a file only)")
    cluster_id = args.cluster_id
    if cluster_id is None:
        if len(clusters) != 1:
            raise InputError(None, "--cluster-id", f"observations cover clusters {clusters}; name one")
        cluster_id = clusters[0]
    elif cluster_id not in clusters:
        raise InputError(None, "--cluster-id", f"no observations of {cluster_id!r}; observed: {clusters}")
    keys = [r["run_key"] for r in runs if r["cluster_key"] == cluster_id]
    obs = [o for k in keys for o in store.read_observations(run_key=k, cluster_key=cluster_id)]
    return cluster_id, keys, obs


def run(args: argparse.Namespace) -> int:
    from flexpipe_dag.calibration import calibrate
    from flexpipe_dag.calibration.report import fidelity_rows, format_report
    from flexpipe_dag.planner.cost_model import CostModel
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.sql.store import Store

    store = Store.from_url()
    cluster_id, run_keys, obs = _observations(store, args)
    latest = store.latest_profile(cluster_id)
    if latest is None:
        raise InputError("store", "profile_versions", f"no stored profile of cluster {cluster_id!r}")
    info, cluster = latest
    model = load_model_spec(args.model)
    prior = store.latest_calibration(info.id, model_name=model.name, dtype=args.dtype)
    if args.report:
        cal = prior
        note = f"calibration version {len(store.calibrations(info.id))} of profile v{info.version}"
        if cal is None:
            cal = calibrate(model, cluster, obs, dtype=args.dtype, group_by=args.group_by)
            note = "no stored calibration: fitted now on these runs (not stored)"
        before = CostModel(model, cluster, dtype=args.dtype, device_overrides=cal.base_overrides)
        print(f"fidelity of the cost model on {cluster_id} (profile v{info.version}, {model.name}, {args.dtype}); "
              f"after = {note}; {len(obs)} observed steps from {len(run_keys)} run(s)")
        print("service times exclude queueing: ttft_service = a prefill micro-batch through every stage, "
              "tpot_service = a decode round trip")
        print(format_report(fidelity_rows(obs, before, cal.cost_model(model, cluster))))
        return 0
    cal = calibrate(model, cluster, obs, dtype=args.dtype, prior=prior, group_by=args.group_by)
    print(f"calibrated {cluster_id} (profile v{info.version}) for {model.name} ({args.dtype}) from {len(obs)} "
          f"steps of {len(run_keys)} run(s)" + (" on top of the previous calibration" if prior else ""))
    for line in cal.summary_lines():
        print("  " + line)
    if args.dry_run:
        print("dry run: nothing stored")
        return 0
    cal_id, version = store.save_calibration(info.id, cal, run_keys=run_keys)
    print(f"stored as calibration version {version} of profile v{info.version} (id {cal_id}); "
          f"the profile's measured figures are unchanged")
    return 0
