"""The profile-refresh job and its schedule (cron configurable; default nightly at 02:00)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from dagster import (
    AssetSelection,
    DefaultScheduleStatus,
    RunRequest,
    ScheduleDefinition,
    ScheduleEvaluationContext,
    SkipReason,
    define_asset_job,
)

from flexpipe_dag.jobs.cron import late_tick_reason, parse_crons

#: Cron of the profile refresh; override with ``FLEXPIPE_PROFILE_REFRESH_CRON`` (several crons separated by ``;``).
DEFAULT_PROFILE_REFRESH_CRON = "0 2 * * *"
PROFILE_REFRESH_CRON_VAR = "FLEXPIPE_PROFILE_REFRESH_CRON"

profile_refresh_job = define_asset_job(
    "profile_refresh",
    selection=AssetSelection.groups("profiling"),
    description="Re-measure the cluster and the model: new profile versions in the SQL store; clears health tags.",
    tags={"dagster/priority": "5"},
)


def profile_refresh_crons(text: str | None = None) -> tuple[str, ...]:
    """The refresh crons: ``text``, else ``FLEXPIPE_PROFILE_REFRESH_CRON``, else nightly 02:00 (UTC).

    One cron, or several separated by ``;`` (e.g. every 90 minutes: ``0 0-21/3 * * *; 30 1-22/3 * * *``).

    Raises:
        InputError: naming ``FLEXPIPE_PROFILE_REFRESH_CRON`` (or "profile_refresh_schedule cron" for ``text``):
            not 5-field crons, or a step beyond its field's range (see :func:`flexpipe_dag.jobs.cron.check_cron`).
    """
    if text is not None:
        return parse_crons(text, "profile_refresh_schedule cron")
    value = (os.environ.get(PROFILE_REFRESH_CRON_VAR) or "").strip() or DEFAULT_PROFILE_REFRESH_CRON
    return parse_crons(value, f"environment variable {PROFILE_REFRESH_CRON_VAR}")


def on_time_only(context: ScheduleEvaluationContext) -> RunRequest | SkipReason:
    """A run for a tick evaluated on time; a skip (with the reason) for a missed one (never backfilled)."""
    from dagster._check import CheckError
    from dagster._time import get_current_timestamp  # Dagster's clock: the one its scheduler ticks by

    try:
        scheduled_s = context.scheduled_execution_time.timestamp()
    except CheckError:  # evaluated by hand, with no tick time (build_schedule_context()): a run
        return RunRequest()
    reason = late_tick_reason(scheduled_s, get_current_timestamp())
    return SkipReason(reason) if reason else RunRequest()


def profile_refresh_schedule(cron: str | Sequence[str] | None = None) -> ScheduleDefinition:
    """The refresh schedule (UTC): ``cron`` (one string, ``;``-separated crons, or a list), else
    :func:`profile_refresh_crons` from the environment.

    A tick runs only when evaluated within :data:`~flexpipe_dag.jobs.cron.LATE_TICK_LIMIT_S` of its time; one
    the scheduler missed (stopped daemon, or a changed cron naming a time already past) is skipped, so a cron
    change never launches a run for a past time.

    Raises:
        InputError: a cron that :func:`profile_refresh_crons` refuses.
    """
    crons = profile_refresh_crons(cron if cron is None or isinstance(cron, str) else ";".join(cron))
    return ScheduleDefinition(
        name="profile_refresh_schedule",
        job=profile_refresh_job,
        cron_schedule=crons[0] if len(crons) == 1 else list(crons),
        execution_fn=on_time_only,
        default_status=DefaultScheduleStatus.RUNNING,
        execution_timezone="UTC",
        description="Re-measure the cluster and the model on the cron; a missed tick is skipped, never run late.",
    )


plan_gears_job = define_asset_job(
    "plan_gears",
    selection=AssetSelection.groups("planning"),
    description="Re-profile the model, plan candidate gears, score them in the simulator, refresh gear health.",
    tags={"dagster/priority": "5"},
)
