"""The FlexPipe store: typed reads and writes over the SQL schema in :mod:`sql.models`.

SQLite (WAL mode, foreign keys on) under ``FLEXPIPE_HOME`` by default; PostgreSQL when
``FLEXPIPE_DATABASE_URL`` is set. Every write that adds several rows runs in one transaction, so bad
input never leaves partial rows behind.

:class:`Store` is the one entry point callers use; each concern lives in its own module over the
shared session helper (:mod:`sql.session`):

=====================  ===========================================================================
:mod:`sql.engine`      engines and store URLs (:func:`make_engine`, :func:`check_store_url`, :func:`shown_url`)
:mod:`sql.schema`      migrations (:func:`migrate`, :func:`downgrade`, :func:`repair`, :func:`require_current`,
                       :func:`current_revision`, :func:`head_revisions`)
:mod:`sql.profiles`    cluster profiles (:class:`~sql.profiles.Profiles`)
:mod:`sql.gears`       model profiles and planned gears (:class:`~sql.gears.Gears`)
:mod:`sql.health`      health tags (:class:`~sql.health.HealthTags`)
:mod:`sql.samples`     metric samples (:class:`~sql.samples.MetricSamples`)
:mod:`sql.pipeline_runs`  which sample-writing runs are live (:class:`~sql.pipeline_runs.PipelineRuns`)
:mod:`sql.shift_events`  shift events, the gear_shift job's channel to the serving process
                       (:class:`~sql.shift_events.ShiftEvents`)
:mod:`sql.jobs`        inference jobs and request results (:class:`~sql.jobs.InferenceJobs`)
:mod:`sql.observations`  stage observations and calibrations (:class:`~sql.observations.Observations`)
:mod:`sql.api_files`   files uploaded through the front door (:class:`~sql.api_files.ApiFiles`)
=====================  ===========================================================================
"""

from __future__ import annotations

from sqlalchemy import Engine

from flexpipe_dag.core.settings import database_url
from flexpipe_dag.sql.api_files import ApiFiles
from flexpipe_dag.sql.engine import alembic_config, check_store_url, make_engine, opening_errors, shown_url
from flexpipe_dag.sql.gears import Gears, spec_hash
from flexpipe_dag.sql.health import HealthTags
from flexpipe_dag.sql.jobs import InferenceJobs
from flexpipe_dag.sql.observations import Observations
from flexpipe_dag.sql.pipeline_runs import PipelineRuns
from flexpipe_dag.sql.profiles import Profiles, ProfileVersionInfo
from flexpipe_dag.sql.samples import MetricSamples
from flexpipe_dag.sql.schema import current_revision, downgrade, head_revisions, migrate, repair, require_current
from flexpipe_dag.sql.shift_events import ShiftEvents

__all__ = ["ProfileVersionInfo", "Store", "alembic_config", "check_store_url", "current_revision", "downgrade",
           "head_revisions", "make_engine", "migrate", "repair", "require_current", "shown_url", "spec_hash"]


class Store(Profiles, Gears, HealthTags, MetricSamples, PipelineRuns, ShiftEvents, InferenceJobs, Observations,
            ApiFiles):
    """Typed access to the FlexPipe store: every concern class over one engine and one session factory.

    Profiles (:class:`~sql.profiles.Profiles`), models and gears (:class:`~sql.gears.Gears`), health
    tags (:class:`~sql.health.HealthTags`), metric samples (:class:`~sql.samples.MetricSamples`), the
    liveness of the runs writing them (:class:`~sql.pipeline_runs.PipelineRuns`), shift
    events (:class:`~sql.shift_events.ShiftEvents`), inference jobs and request results
    (:class:`~sql.jobs.InferenceJobs`), stage observations and calibrations
    (:class:`~sql.observations.Observations`); see each for its tables and errors.

    Args:
        engine: an SQLAlchemy engine (see :func:`make_engine`).
        auto_migrate: upgrade the schema to head on construction (default True; atomic, one process at a
            time, see :mod:`flexpipe_dag.sql.schema`); False checks the schema is at head instead.

    Raises:
        InputError: with ``auto_migrate``, the store is half-migrated and holds rows; without it, the
            schema is not at head (the message names ``flexpipe store upgrade``).
    """

    def __init__(self, engine: Engine, auto_migrate: bool = True):
        if auto_migrate:
            migrate(engine)
        else:
            require_current(engine)
        super().__init__(engine)

    @classmethod
    def from_url(cls, url: str | None = None, auto_migrate: bool = True) -> Store:
        """Open (and migrate) the store at ``url`` (default :func:`database_url`).

        Raises:
            InputError: the URL does not parse, names an in-memory SQLite database, its driver is not
                installed, or the database cannot be reached or opened (the URL is named, its password hidden).
        """
        url = url or database_url()
        shown = check_store_url(url)
        with opening_errors(shown, url):
            return cls(make_engine(url), auto_migrate=auto_migrate)
