"""Module-level job factories so ``flexpipe demo`` can launch the code location's jobs with
``dagster.reconstructable`` (runs then appear in the instance like any launched from the UI)."""

from __future__ import annotations

from flexpipe_dag.definitions import defs


def profile_refresh():
    return defs.resolve_job_def("profile_refresh")


def plan_gears():
    return defs.resolve_job_def("plan_gears")


def batch_inference():
    return defs.resolve_job_def("batch_inference")


def serve_trace():
    return defs.resolve_job_def("serve_trace")


def serve_frontdoor():
    return defs.resolve_job_def("serve_frontdoor")


#: Jobs the demo runs, in order.
DEMO_JOBS = {"profile_refresh": profile_refresh, "plan_gears": plan_gears, "batch_inference": batch_inference,
             "serve_trace": serve_trace, "serve_frontdoor": serve_frontdoor}


def get_job_factory(name: str):
    return DEMO_JOBS[name]
