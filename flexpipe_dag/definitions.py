"""The FlexPipe Dagster code location: one ``Definitions`` object (``dagster dev -m flexpipe_dag.definitions``).

Resources are environment-driven: ``FLEXPIPE_DATABASE_URL`` (store), ``FLEXPIPE_CLUSTER_FILE`` (a
declared inventory merged with what is measured), ``FLEXPIPE_PROBE`` (``0`` to skip measuring),
:data:`PLANNING_ENV` (model, dtype, SLOs, length caps) and ``FLEXPIPE_CONTROL_FILE`` /
``FLEXPIPE_DWELL_S`` (controller and tide figures).
"""

from __future__ import annotations

import os
import warnings

from dagster import BetaWarning, Definitions, load_asset_checks_from_modules, load_assets_from_modules

from assets import calibration, evaluation, health, planning, profiling
from jobs.batch import batch_inference
from jobs.gear_shift import gear_shift, gear_shift_sensor
from jobs.profiling import plan_gears_job, profile_refresh_job, profile_refresh_schedule
from jobs.replan import replan_sensor
from jobs.serve import serve_trace
from jobs.tide import tide_sensor
from resources.control import ControlSettings
from resources.planning import PlanningSettings
from resources.prober import ProberResource
from resources.store_resource import StoreResource

# Dagster's own beta notices (e.g. the sensor `owners` parameter it passes itself) say nothing to a user.
warnings.filterwarnings("ignore", category=BetaWarning, module=r"dagster\..*")

ASSET_MODULES = [profiling, planning, calibration, evaluation, health]


#: Environment variables that set PlanningSettings fields (unset: the field's default).
PLANNING_ENV = {"FLEXPIPE_MODEL": "model", "FLEXPIPE_PLAN_DTYPE": "dtype", "FLEXPIPE_SLO_TTFT_MS": "slo_ttft_ms",
                "FLEXPIPE_SLO_TPOT_MS": "slo_tpot_ms", "FLEXPIPE_MAX_PROMPT_TOKENS": "max_prompt_tokens",
                "FLEXPIPE_MAX_NEW_TOKENS": "max_new_tokens", "FLEXPIPE_PLAN_CONCURRENCY": "concurrency",
                "FLEXPIPE_REFERENCE_REQUESTS": "reference_requests", "FLEXPIPE_STAGE_REPLICAS": "stage_replicas"}


def _planning_env() -> dict:
    fields = PlanningSettings.model_fields
    out = {}
    for var, name in PLANNING_ENV.items():
        if os.environ.get(var):
            kind = fields[name].annotation
            value = os.environ[var]
            out[name] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return out


def build_resources() -> dict:
    """Resources from the environment (see module docstring)."""
    return {
        "store": StoreResource(database_url=os.environ.get("FLEXPIPE_DATABASE_URL", "")),
        "prober": ProberResource(probe=os.environ.get("FLEXPIPE_PROBE", "1") != "0",
                                 cluster_file=os.environ.get("FLEXPIPE_CLUSTER_FILE", "")),
        "planning": PlanningSettings(**_planning_env()),
        "control": ControlSettings(config_file=os.environ.get("FLEXPIPE_CONTROL_FILE", ""),
                                   dwell_s=float(os.environ.get("FLEXPIPE_DWELL_S", "-1"))),
    }


defs = Definitions(
    assets=load_assets_from_modules(ASSET_MODULES),
    asset_checks=load_asset_checks_from_modules(ASSET_MODULES),
    jobs=[profile_refresh_job, plan_gears_job, serve_trace, gear_shift, batch_inference],
    sensors=[gear_shift_sensor, tide_sensor, replan_sensor],
    schedules=[profile_refresh_schedule()],
    resources=build_resources(),
)
