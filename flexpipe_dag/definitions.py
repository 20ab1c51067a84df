"""The FlexPipe Dagster code location: one ``Definitions`` object (``dagster dev -m flexpipe_dag.definitions``).

Resources are environment-driven: ``FLEXPIPE_DATABASE_URL`` (store), ``FLEXPIPE_CLUSTER_FILE`` (a
declared inventory merged with what is measured) and ``FLEXPIPE_PROBE`` (``0`` to skip measuring).
"""

from __future__ import annotations

import os

from dagster import Definitions, load_asset_checks_from_modules, load_assets_from_modules

from assets import evaluation, health, planning, profiling
from jobs.batch import batch_inference
from jobs.gear_shift import gear_shift, gear_shift_sensor
from jobs.profiling import plan_gears_job, profile_refresh_job, profile_refresh_schedule
from jobs.serve import serve_trace
from jobs.tide import tide_sensor
from resources.control import ControlSettings
from resources.planning import PlanningSettings
from resources.prober import ProberResource
from resources.store_resource import StoreResource

ASSET_MODULES = [profiling, planning, evaluation, health]


def build_resources() -> dict:
    """Resources from the environment (see module docstring)."""
    return {
        "store": StoreResource(database_url=os.environ.get("FLEXPIPE_DATABASE_URL", "")),
        "prober": ProberResource(probe=os.environ.get("FLEXPIPE_PROBE", "1") != "0",
                                 cluster_file=os.environ.get("FLEXPIPE_CLUSTER_FILE", "")),
        "planning": PlanningSettings(model=os.environ.get("FLEXPIPE_MODEL", "SmolLM2-135M")),
        "control": ControlSettings(config_file=os.environ.get("FLEXPIPE_CONTROL_FILE", "")),
    }


defs = Definitions(
    assets=load_assets_from_modules(ASSET_MODULES),
    asset_checks=load_asset_checks_from_modules(ASSET_MODULES),
    jobs=[profile_refresh_job, plan_gears_job, serve_trace, gear_shift, batch_inference],
    sensors=[gear_shift_sensor, tide_sensor],
    schedules=[profile_refresh_schedule()],
    resources=build_resources(),
)
