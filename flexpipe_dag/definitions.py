"""The FlexPipe Dagster code location: one ``Definitions`` object (``dagster dev -m flexpipe_dag.definitions``).

Resources are environment-driven: ``FLEXPIPE_DATABASE_URL`` (store), ``FLEXPIPE_CLUSTER_FILE`` (a
declared inventory merged with what is measured), ``FLEXPIPE_PROBE`` (``0`` to skip measuring),
:data:`PLANNING_ENV` (model, dtype, SLOs, length caps) and ``FLEXPIPE_CONTROL_FILE`` /
``FLEXPIPE_DWELL_S`` (controller and tide figures).

Every numeric and boolean variable is parsed with :func:`flexpipe_dag.core.settings.env_value`: a
bad value (``FLEXPIPE_DWELL_S=abc``, ``FLEXPIPE_PLAN_CONCURRENCY=0``, ``FLEXPIPE_PROBE=maybe``) makes
loading the code location fail with one :class:`~flexpipe_dag.core.errors.InputError` naming the
variable, the expected type and range, and the value given. So do an unknown
``FLEXPIPE_PLAN_DTYPE``, an invalid ``FLEXPIPE_PROFILE_REFRESH_CRON`` and a
``FLEXPIPE_DATABASE_URL`` that does not parse or names an in-memory SQLite database.
"""

from __future__ import annotations

import os
import warnings

from dagster import BetaWarning, Definitions, load_asset_checks_from_modules, load_assets_from_modules

from flexpipe_dag.assets import calibration, evaluation, health, planning, profiling
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.settings import INT32_MAX, env_value
from flexpipe_dag.jobs.batch import batch_inference
from flexpipe_dag.jobs.gear_shift import gear_shift, gear_shift_sensor
from flexpipe_dag.jobs.profiling import (
    DEFAULT_PROFILE_REFRESH_CRON,
    plan_gears_job,
    profile_refresh_job,
    profile_refresh_schedule,
)
from flexpipe_dag.jobs.replan import replan_sensor
from flexpipe_dag.jobs.serve import serve_trace
from flexpipe_dag.jobs.tide import tide_sensor
from flexpipe_dag.resources.control import ControlSettings
from flexpipe_dag.resources.planning import PlanningSettings
from flexpipe_dag.resources.prober import ProberResource
from flexpipe_dag.resources.store_resource import StoreResource
from flexpipe_dag.sql.store import check_store_url

# Dagster's own beta notices (e.g. the sensor `owners` parameter it passes itself) say nothing to a user.
warnings.filterwarnings("ignore", category=BetaWarning, module=r"dagster\..*")

ASSET_MODULES = [profiling, planning, calibration, evaluation, health]


#: Environment variables that set PlanningSettings fields (unset: the field's default).
PLANNING_ENV = {"FLEXPIPE_MODEL": "model", "FLEXPIPE_PLAN_DTYPE": "dtype", "FLEXPIPE_SLO_TTFT_MS": "slo_ttft_ms",
                "FLEXPIPE_SLO_TPOT_MS": "slo_tpot_ms", "FLEXPIPE_MAX_PROMPT_TOKENS": "max_prompt_tokens",
                "FLEXPIPE_MAX_NEW_TOKENS": "max_new_tokens", "FLEXPIPE_PLAN_CONCURRENCY": "concurrency",
                "FLEXPIPE_REFERENCE_REQUESTS": "reference_requests", "FLEXPIPE_STAGE_REPLICAS": "stage_replicas"}


#: The field types :func:`_planning_env` parses with ``env_value`` (others are taken as stripped strings).
_SCALAR_KINDS: dict[object, type[int | float | bool]] = {int: int, float: float, bool: bool}


def _unit_of(name: str) -> str:
    """Unit named by a field's suffix, for error messages."""
    for suffix, unit in (("_ms", "milliseconds"), ("_s", "seconds"), ("_tokens", "tokens")):
        if name.endswith(suffix):
            return unit
    return ""


def _bounds_of(field) -> dict:
    """``ge`` / ``gt`` / ``le`` / ``lt`` of a pydantic field's ``Field(...)`` constraints."""
    out = {}
    for constraint in field.metadata:
        for key in ("ge", "gt", "le", "lt"):
            value = getattr(constraint, key, None)
            if value is not None:
                out[key] = value
    return out


def _planning_env() -> dict:
    """PlanningSettings fields set by :data:`PLANNING_ENV` variables, each parsed and range-checked.

    Raises:
        InputError: a variable is not of its field's type (int / float / bool) or is outside the
            field's range (named: variable, expected type and range, value given); an unknown dtype.
    """
    from flexpipe_dag.core.dtypes import canonical_dtype

    fields = PlanningSettings.model_fields
    out: dict[str, object] = {}
    for var, name in PLANNING_ENV.items():
        kind = _SCALAR_KINDS.get(fields[name].annotation)
        value: object
        if kind is not None:
            bounds = _bounds_of(fields[name])
            if kind is int:
                bounds.setdefault("le", INT32_MAX)
            value = env_value(var, kind, None, unit=_unit_of(name), **bounds)
        else:
            value = (os.environ.get(var) or "").strip() or None
        if value is not None:
            out[name] = value
    if "dtype" in out:
        out["dtype"] = canonical_dtype(str(out["dtype"]), "environment variable FLEXPIPE_PLAN_DTYPE", None)
    return out


def _profile_refresh_cron() -> str:
    """``FLEXPIPE_PROFILE_REFRESH_CRON`` or the nightly default; InputError for an invalid cron string."""
    from dagster._utils.schedules import is_valid_cron_string

    cron = (os.environ.get("FLEXPIPE_PROFILE_REFRESH_CRON") or "").strip() or DEFAULT_PROFILE_REFRESH_CRON
    if not is_valid_cron_string(cron):
        raise InputError("environment variable FLEXPIPE_PROFILE_REFRESH_CRON", None,
                         f"expected a 5-field cron expression such as '0 2 * * *', got {cron!r}")
    return cron


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
    return {
        "store": StoreResource(database_url=database_url),
        "prober": ProberResource(probe=env_value("FLEXPIPE_PROBE", bool, True),
                                 cluster_file=os.environ.get("FLEXPIPE_CLUSTER_FILE", "")),
        "planning": PlanningSettings(**_planning_env()),
        "control": control,
    }


defs = Definitions(
    assets=load_assets_from_modules(ASSET_MODULES),
    asset_checks=load_asset_checks_from_modules(ASSET_MODULES),
    jobs=[profile_refresh_job, plan_gears_job, serve_trace, gear_shift, batch_inference],
    sensors=[gear_shift_sensor, tide_sensor, replan_sensor],
    schedules=[profile_refresh_schedule(_profile_refresh_cron())],
    resources=build_resources(),
)
