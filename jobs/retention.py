"""The ``store_retention`` job and its nightly schedule: metric samples older than the retention are deleted, and
the uploaded files (Batch API input) that have expired, unless a batch that has not ended still reads them, and the
result rows of the batches whose output files have expired.

A serving run writes a pipeline row and one row per stage every 2 s (about 170,000 rows a day on 3 stages);
nothing reads them after the sensors have (their cursors move on) and the run's report is written, so a store
that serves for weeks is pruned nightly to the retention (default 14 days, ``FLEXPIPE_SAMPLE_RETENTION_DAYS``, or
the op's ``keep_days``). ``flexpipe store prune`` does the same by hand.
"""

from dagster import (
    Config,
    DefaultScheduleStatus,
    MetadataValue,
    OpExecutionContext,
    ScheduleDefinition,
    job,
    op,
)
from pydantic import Field

from flexpipe_dag.core.settings import DEFAULT_SAMPLE_RETENTION_DAYS, sample_retention_s
from flexpipe_dag.jobs.profiling import on_time_only
from flexpipe_dag.resources.store_resource import StoreResource

#: When the schedule prunes (UTC): nightly, an hour after the profile refresh.
STORE_RETENTION_CRON = "0 3 * * *"


class StoreRetentionConfig(Config):
    """How long metric samples are kept."""

    keep_days: float | None = Field(
        default=None, description="retention, days (at least 1 hour = 0.0417); empty = FLEXPIPE_SAMPLE_RETENTION_DAYS, "
                                  f"else {DEFAULT_SAMPLE_RETENTION_DAYS:g}")
    dry_run: bool = Field(default=False, description="count the rows that would go, delete nothing")


@op(description="Delete the metric samples written before the retention window (in chunks; sensors' cursors and "
                "live runs are unaffected).")
def prune_metric_samples(context: OpExecutionContext, config: StoreRetentionConfig, store: StoreResource) -> int:
    """Rows deleted (or counted on a dry run); the line and the cutoff go to the run's metadata.

    Raises:
        InputError: ``keep_days`` (or ``FLEXPIPE_SAMPLE_RETENTION_DAYS``) not a number of days from 1 hour to
            10 years (nothing deleted).
    """
    keep_s = sample_retention_s(config.keep_days, field="keep_days")
    result = store.get_store().prune_samples(keep_s, dry_run=config.dry_run)
    context.log.info(result.describe())
    context.add_output_metadata({"rows": result.rows, "cutoff": MetadataValue.text(result.cutoff.isoformat()),
                                 "dry_run": result.dry_run, "keep_days": keep_s / 86400})
    return result.rows


class ExpiredConfig(Config):
    """Whether what has expired is only counted."""

    dry_run: bool = Field(default=False, description="count what would go, delete nothing")


@op(description="Delete the uploaded files (Batch API input) that have expired, except those a batch that has not "
                "ended still reads (they go at a later prune).")
def prune_expired_files(context: OpExecutionContext, config: ExpiredConfig, store: StoreResource) -> int:
    """Files deleted (or counted on a dry run); the line, bytes and files kept go to the run's metadata."""
    result = store.get_store().prune_api_files(dry_run=config.dry_run)
    context.log.info(result.describe())
    context.add_output_metadata({"files": result.files, "bytes": result.bytes, "kept_in_use": result.kept,
                                 "dry_run": result.dry_run})
    return result.files


@op(description="Delete the result rows of the Batch API batches whose output and error files have expired "
                "(output_expires_after, 30 days after the batch ended by default); each batch keeps its counts.")
def prune_expired_batch_results(context: OpExecutionContext, config: ExpiredConfig, store: StoreResource) -> int:
    """Result rows deleted (or counted on a dry run); the line, rows and batches go to the run's metadata."""
    result = store.get_store().prune_batch_results(dry_run=config.dry_run)
    context.log.info(result.describe())
    context.add_output_metadata({"rows": result.rows, "batches": result.batches, "dry_run": result.dry_run})
    return result.rows


@job(description="Prune the store: metric samples older than the retention (FLEXPIPE_SAMPLE_RETENTION_DAYS, "
                 f"default {DEFAULT_SAMPLE_RETENTION_DAYS:g} days), expired uploaded files and the results of batches "
                 "whose output files expired.", tags={"dagster/priority": "-5"})
def store_retention():
    prune_metric_samples()
    prune_expired_files()
    prune_expired_batch_results()


store_retention_schedule = ScheduleDefinition(
    name="store_retention_schedule",
    job=store_retention,
    cron_schedule=STORE_RETENTION_CRON,
    execution_fn=on_time_only,
    default_status=DefaultScheduleStatus.RUNNING,
    execution_timezone="UTC",
    description="Nightly at 03:00 UTC: delete metric samples older than the retention, expired uploaded files and "
                "expired batch results; a missed tick is skipped.",
)
