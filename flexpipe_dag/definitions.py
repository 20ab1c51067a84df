"""The FlexPipe Dagster code location: one ``Definitions`` object (``dagster dev -m flexpipe_dag.definitions``).

Resources are environment-driven: ``FLEXPIPE_DATABASE_URL`` (store), ``FLEXPIPE_CLUSTER_FILE`` (a
declared inventory merged with what is measured), ``FLEXPIPE_PROBE`` (``0`` to skip measuring),
:data:`PLANNING_ENV` (model, dtype, SLOs, length caps) and ``FLEXPIPE_CONTROL_FILE`` /
``FLEXPIPE_DWELL_S`` (controller and tide figures), ``FLEXPIPE_SAMPLE_RETENTION_DAYS`` (how long metric samples
are kept, checked here).

Every numeric and boolean variable is parsed with :func:`flexpipe_dag.core.settings.env_value`: a
bad value (``FLEXPIPE_DWELL_S=abc``, ``FLEXPIPE_PLAN_CONCURRENCY=0``, ``FLEXPIPE_PROBE=maybe``) makes
loading the code location fail with one :class:`~flexpipe_dag.core.errors.InputError` naming the
variable, the expected type and range, and the value given. So do an unknown
``FLEXPIPE_PLAN_DTYPE``, an invalid ``FLEXPIPE_PROFILE_REFRESH_CRON`` (also a step beyond its field's
range, ``*/90`` minutes) and a
``FLEXPIPE_DATABASE_URL`` that does not parse or names an in-memory SQLite database (its password
masked in the message). The store resource reads ``FLEXPIPE_DATABASE_URL`` as a ``dagster.EnvVar``, so
no run snapshot, UI page or log holds the URL's password.
"""

from __future__ import annotations

import os
import warnings

from dagster import BetaWarning, Definitions, EnvVar, load_asset_checks_from_modules, load_assets_from_modules

from flexpipe_dag.assets import calibration, capacity, evaluation, fleet, health, mixed_day, planning, profiling
from flexpipe_dag.core.settings import env_value, sample_retention_s
from flexpipe_dag.jobs import config_scaffold
from flexpipe_dag.jobs.batch import batch_inference
from flexpipe_dag.jobs.gear_shift import gear_shift, gear_shift_sensor
from flexpipe_dag.jobs.profiling import (
    plan_gears_job,
    profile_refresh_job,
    profile_refresh_schedule,
)
from flexpipe_dag.jobs.replan import replan_sensor
from flexpipe_dag.jobs.retention import store_retention, store_retention_schedule
from flexpipe_dag.jobs.serve import serve_trace
from flexpipe_dag.jobs.serve_frontdoor import serve_frontdoor
from flexpipe_dag.jobs.tide import tide_sensor
from flexpipe_dag.resources.control import ControlSettings
from flexpipe_dag.resources.planning import PlanningSettings, planning_from_env
from flexpipe_dag.resources.prober import ProberResource
from flexpipe_dag.resources.store_resource import StoreResource
from flexpipe_dag.sql.store import check_store_url

# `dagster job scaffold_config` (which imports its scaffolder before loading this module) for every job
config_scaffold.install()
# Dagster's own beta notices (e.g. the sensor `owners` parameter it passes itself) say nothing to a user.
warnings.filterwarnings("ignore", category=BetaWarning, module=r"dagster\..*")

ASSET_MODULES = [profiling, planning, calibration, evaluation, health, capacity, mixed_day, fleet]


def build_resources() -> dict:
    """Resources from the environment (see module docstring).

    Raises:
        InputError: a variable of the module docstring holds a bad value (the variable is named), or
            the control file (``FLEXPIPE_CONTROL_FILE``) a bad figure (file and field named).
    """
    database_url = (os.environ.get("FLEXPIPE_DATABASE_URL") or "").strip()
    if database_url:
        check_store_url(database_url)
    control = ControlSettings(config_file=os.environ.get("FLEXPIPE_CONTROL_FILE", ""),
                              dwell_s=env_value("FLEXPIPE_DWELL_S", float, None, ge=0, unit="seconds"))
    control.resolved()  # read and validated once, here: a bad control file fails the load, not the first tick
    sample_retention_s()  # FLEXPIPE_SAMPLE_RETENTION_DAYS: a bad value fails the load, not the nightly prune
    return {
        # by name, never the value: Dagster keeps a literal (and its password) in every run's job snapshot
        "store": StoreResource(database_url=EnvVar("FLEXPIPE_DATABASE_URL") if database_url else ""),
        "prober": ProberResource(probe=env_value("FLEXPIPE_PROBE", bool, True),
                                 cluster_file=os.environ.get("FLEXPIPE_CLUSTER_FILE", "")),
        "planning": PlanningSettings(**planning_from_env()),
        "control": control,
    }


defs = Definitions(
    assets=load_assets_from_modules(ASSET_MODULES),
    asset_checks=load_asset_checks_from_modules(ASSET_MODULES),
    jobs=[profile_refresh_job, plan_gears_job, serve_trace, serve_frontdoor, gear_shift, batch_inference,
          store_retention],
    sensors=[gear_shift_sensor, tide_sensor, replan_sensor],
    schedules=[profile_refresh_schedule(), store_retention_schedule],  # FLEXPIPE_PROFILE_REFRESH_CRON, checked
    resources=build_resources(),
)
