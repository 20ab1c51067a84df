"""The profile-refresh job and its schedule (cron configurable; default nightly at 02:00)."""

from __future__ import annotations

import os

from dagster import AssetSelection, DefaultScheduleStatus, ScheduleDefinition, define_asset_job

#: Cron of the profile refresh; override with ``FLEXPIPE_PROFILE_REFRESH_CRON``.
DEFAULT_PROFILE_REFRESH_CRON = "0 2 * * *"

profile_refresh_job = define_asset_job(
    "profile_refresh",
    selection=AssetSelection.groups("profiling"),
    description="Re-measure the cluster and the model: new profile versions in the SQL store; clears health tags.",
    tags={"dagster/priority": "5"},
)


def profile_refresh_schedule(cron: str | None = None) -> ScheduleDefinition:
    """The refresh schedule; ``cron`` defaults to ``FLEXPIPE_PROFILE_REFRESH_CRON`` or nightly 02:00."""
    return ScheduleDefinition(
        name="profile_refresh_schedule",
        job=profile_refresh_job,
        cron_schedule=cron or os.environ.get("FLEXPIPE_PROFILE_REFRESH_CRON", DEFAULT_PROFILE_REFRESH_CRON),
        default_status=DefaultScheduleStatus.RUNNING,
        execution_timezone="UTC",
    )


plan_gears_job = define_asset_job(
    "plan_gears",
    selection=AssetSelection.groups("planning"),
    description="Re-profile the model, plan candidate gears, score them in the simulator, refresh gear health.",
    tags={"dagster/priority": "5"},
)
