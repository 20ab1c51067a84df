"""``flexpipe demo``: the main job, run as Dagster runs on this host's instance (``DAGSTER_HOME``).

Runs are recorded in the Dagster instance, so ``make dev`` (``dagster dev``) shows them afterwards.
"""

from __future__ import annotations

import argparse
import os
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job end to end as Dagster runs", description=__doc__)
    p.add_argument("--cluster", metavar="FILE", default="",
                   help="declared fleet to merge with this host's measurement (default: the bundled example)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dagster import DagsterInstance, execute_job, reconstructable

    from flexpipe_dag import demo_defs

    if args.cluster:
        os.environ["FLEXPIPE_CLUSTER_FILE"] = args.cluster
    instance = DagsterInstance.get() if os.environ.get("DAGSTER_HOME") else DagsterInstance.ephemeral()
    for job_name in demo_defs.DEMO_JOBS:
        print(f"== dagster run: {job_name}", flush=True)
        result = execute_job(reconstructable(demo_defs.get_job_factory(job_name)), instance=instance)
        if not result.success:
            print(f"flexpipe demo: run {result.run_id} of {job_name} failed; see `make dev` -> Runs", file=sys.stderr)
            return 1
        print(f"   run {result.run_id}: success", flush=True)
    return 0
