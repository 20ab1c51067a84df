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


#: What records the steps calibration fits, for the messages that find none.
RECORDERS = ("the Dagster batch_inference job (gear_id: or stages:) or `flexpipe demo` record every stage step "
             "in the store (`flexpipe run` writes its results to a file only)")


def _observations(store, args) -> tuple[str, list[str], list, tuple]:
    """The stored steps a calibration can use: ``(cluster_id, run_keys, observations, (info, cluster))``.

    Usable steps are those of a cluster with a stored profile (``--cluster-id``, else the only such
    cluster observed) that ran on a device of that profile; the rest are counted in a printed note.

    Raises:
        InputError: one line saying why no step is usable and what records or profiles them: nothing
            observed (of ``--run-key``), no observed cluster with a stored profile, ``--cluster-id`` not
            observed or not profiled, several profiled clusters and no ``--cluster-id``, or no step on a
            device of the profile.
    """
    runs = store.observed_runs()
    if args.run_key:
        runs = [r for r in runs if r["run_key"] in args.run_key]
        if not runs:
            raise InputError(None, "--run-key", f"no observed stage steps of run(s) {', '.join(args.run_key)}")
    if not runs:
        raise InputError(None, None, f"no observed steps in the store yet: {RECORDERS}")
    clusters = sorted({r["cluster_key"] for r in runs if r["cluster_key"]})
    profiled = [c for c in clusters if store.latest_profile(c) is not None]
    cluster_id = args.cluster_id
    if cluster_id is None:
        if not profiled:
            steps = sum(r["steps"] for r in runs)
            where = (f"clusters without a stored profile ({', '.join(clusters)})" if clusters
                     else "no cluster (gears that name none, on remote workers)")
            raise InputError(None, None, f"none of the {steps} observed stage steps is usable: they ran on {where}; "
                                         "profile the cluster they ran on (the profile_refresh job on its host), "
                                         "then calibrate")
        if len(profiled) != 1:
            raise InputError(None, "--cluster-id", f"observations cover profiled clusters {', '.join(profiled)}; "
                                                   "name one")
        cluster_id = profiled[0]
    elif cluster_id not in clusters:
        raise InputError(None, "--cluster-id", f"no observed stage steps of {cluster_id!r}; observed: "
                                               f"{', '.join(clusters) or 'none with a cluster'}")
    elif cluster_id not in profiled:
        raise InputError(None, "--cluster-id", f"cluster {cluster_id!r} has observed steps but no stored profile: "
                                               "profile it (the profile_refresh job on its host), then calibrate")
    latest = store.latest_profile(cluster_id)
    info, cluster = latest
    pairs = list(dict.fromkeys((r["run_key"], r["gear_key"]) for r in runs if r["cluster_key"] == cluster_id))
    obs = [o for k, g in pairs for o in store.read_observations(run_key=k, gear_key=g, cluster_key=cluster_id)]
    known = {d.device_id for d in cluster.devices}
    usable = [o for o in obs if o.device_id in known]
    if not usable:
        ran_on = sorted({o.device_id for o in obs})
        raise InputError(None, None, f"none of the {len(obs)} observed stage steps of cluster {cluster_id} ran on a "
                                     f"device of its profile v{info.version} (steps on {', '.join(ran_on)}; profile "
                                     f"devices {', '.join(sorted(known))}): profile the devices the runs used")
    if len(usable) < len(obs):
        print(f"note: {len(obs) - len(usable)} of {len(obs)} observed steps ran on devices not in profile "
              f"v{info.version} of {cluster_id}; left out")
    return cluster_id, list(dict.fromkeys(k for k, _ in pairs)), usable, latest


def _check_model(model, observations) -> None:
    """Raise InputError when the steps cover layers ``model`` does not have (``--model`` is not the model they ran)."""
    top = max(o.layer_end for o in observations)
    if top > model.num_layers:
        raise InputError(None, "--model", f"the observed steps cover layers up to {top}, but {model.name} has "
                                          f"{model.num_layers}: name the model the runs served")


def run(args: argparse.Namespace) -> int:
    from flexpipe_dag.calibration import calibrate
    from flexpipe_dag.calibration.report import fidelity_rows, format_report
    from flexpipe_dag.planner.cost_model import CostModel
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.sql.store import Store

    store = Store.from_url()
    cluster_id, run_keys, obs, (info, cluster) = _observations(store, args)
    model = load_model_spec(args.model)
    _check_model(model, obs)
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
