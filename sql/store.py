"""The FlexPipe store: typed reads and writes over the SQL schema in :mod:`sql.models`.

SQLite (WAL mode, foreign keys on) under ``FLEXPIPE_HOME`` by default; PostgreSQL when
``FLEXPIPE_DATABASE_URL`` is set. Every write that adds several rows runs in one transaction, so bad
input never leaves partial rows behind.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload, sessionmaker

from flexpipe_dag.core.cluster import ClusterProfile, Device, Link
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.metrics import MetricSample, StageSample
from flexpipe_dag.core.settings import database_url
from flexpipe_dag.sql import models as m

_SQL_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class ProfileVersionInfo:
    """Identity of a stored profile version."""

    id: int
    cluster_key: str
    version: int
    source: str
    measured_at: dt.datetime


def make_engine(url: str | None = None, **engine_kwargs: Any) -> Engine:
    """Create an engine for ``url`` (default: :func:`database_url`), with SQLite set up for WAL.

    ``engine_kwargs`` go to :func:`sqlalchemy.create_engine` (e.g. ``connect_args``).
    """
    url = url or database_url()
    engine = create_engine(url, **engine_kwargs)
    if engine.dialect.name == "sqlite":
        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # pragma: no cover - exercised by every SQLite test
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()
    return engine


def alembic_config(engine: Engine | None = None) -> Config:
    """Alembic config pointing at the packaged migrations (``sql/migrations``)."""
    cfg = Config(str(_SQL_DIR / "alembic.ini"))
    cfg.set_main_option("script_location", str(_SQL_DIR / "migrations"))
    if engine is not None:
        cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def _run_alembic(engine: Engine, fn, revision: str) -> None:
    """Run an Alembic command on one connection.

    On SQLite, foreign keys are switched off for the migration: a batch ALTER recreates the table,
    and with ``ON DELETE CASCADE`` enforced, dropping the old copy would delete its child rows.
    """
    cfg = alembic_config(engine)
    with engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            conn.commit()
        try:
            with conn.begin():
                cfg.attributes["connection"] = conn
                fn(cfg, revision)
        finally:
            if sqlite:
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                conn.commit()


def migrate(engine: Engine, revision: str = "head") -> None:
    """Upgrade the database behind ``engine`` to ``revision`` (idempotent)."""
    _run_alembic(engine, command.upgrade, revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Downgrade the database behind ``engine`` to ``revision`` (``"base"`` drops everything)."""
    _run_alembic(engine, command.downgrade, revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revisions() -> tuple[str, ...]:
    return tuple(ScriptDirectory.from_config(alembic_config()).get_heads())


def spec_hash(spec: dict[str, Any]) -> str:
    """Stable SHA-256 of a JSON-able spec (sorted keys)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or math.isinf(x) else x


def check_store_url(url: str, source: str = "FLEXPIPE_DATABASE_URL") -> str:
    """Check a store URL without connecting; return it for messages (password hidden).

    An in-memory SQLite database (``sqlite://``, ``sqlite:///:memory:``, ``file::memory:`` or
    ``mode=memory`` URIs) is refused: every process and every pooled connection would get its own
    empty database, so what one Dagster run or stage worker wrote would be invisible to the next and
    vanish on exit.

    Raises:
        InputError: ``source`` named; the URL does not parse, or it names an in-memory database.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise InputError(source, None,
                         f"{url!r} is not a database URL; expected e.g. sqlite:///path/flexpipe.db or "
                         "postgresql+psycopg2://user@host:5432/db") from None
    shown = parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() == "sqlite":
        database = (parsed.database or "").strip()
        mode = parsed.query.get("mode")
        modes = (mode,) if isinstance(mode, str) else tuple(mode or ())
        if database in ("", ":memory:") or database.startswith("file::memory:") or "memory" in modes \
                or "mode=memory" in database:
            raise InputError(source, None,
                             f"{url.strip()!r} is an in-memory SQLite database: every process and connection would get "
                             "its own empty store and results would vanish; expected a file, e.g. "
                             "sqlite:////abs/path/flexpipe.db (or leave FLEXPIPE_DATABASE_URL unset for "
                             "$FLEXPIPE_HOME/flexpipe.db)")
    return shown


class Store:
    """Typed access to the FlexPipe store.

    Args:
        engine: an SQLAlchemy engine (see :func:`make_engine`).
        auto_migrate: upgrade the schema to head on construction (default True).
    """

    def __init__(self, engine: Engine, auto_migrate: bool = True):
        self.engine = engine
        if auto_migrate:
            migrate(engine)
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def from_url(cls, url: str | None = None, auto_migrate: bool = True) -> Store:
        """Open (and migrate) the store at ``url`` (default :func:`database_url`).

        Raises:
            InputError: the URL does not parse, names an in-memory SQLite database, its driver is not
                installed, or the database cannot be reached or opened (the URL is named, its password hidden).
        """
        from sqlalchemy.exc import DBAPIError, NoSuchModuleError

        url = url or database_url()
        shown = check_store_url(url)
        try:
            return cls(make_engine(url), auto_migrate=auto_migrate)
        except (NoSuchModuleError, ModuleNotFoundError) as exc:
            raise InputError("FLEXPIPE_DATABASE_URL", None, f"no driver for {shown}: {exc}; "
                             "use sqlite:/// or postgresql+psycopg2:// (pip install -e .[postgres])") from None
        except DBAPIError as exc:
            reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc).splitlines()[0]
            raise InputError("FLEXPIPE_DATABASE_URL", None, f"cannot open the store at {shown}: {reason}") from None

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on any error."""
        with self._sessions.begin() as s:
            yield s

    # -- profiles -------------------------------------------------------------------------------
    def save_profile(self, profile: ClusterProfile) -> ProfileVersionInfo:
        """Store ``profile`` as the next version of its cluster (all rows in one transaction)."""
        with self.session() as s:
            cluster = s.scalar(select(m.Cluster).where(m.Cluster.cluster_key == profile.cluster_id))
            if cluster is None:
                cluster = m.Cluster(cluster_key=profile.cluster_id)
                s.add(cluster)
                s.flush()
            last = s.scalar(select(func.max(m.ProfileVersion.version)).where(m.ProfileVersion.cluster_id == cluster.id))
            pv = m.ProfileVersion(cluster_id=cluster.id, version=(last or 0) + 1, source=profile.source,
                                  measured_at=profile.measured_at, notes=list(profile.notes))
            pv.devices = [
                m.DeviceRow(device_key=d.device_id, node_key=d.node_id, model_name=d.model_name,
                            generation=d.generation, kind=d.kind, memory_gib=d.memory_gib,
                            peak_tflops=d.peak_tflops, hbm_bandwidth_gbps=d.hbm_bandwidth_gbps,
                            compute_score=d.compute_score, max_micro_batch=d.max_micro_batch,
                            available_until=d.available_until, op_timings_ms=dict(d.op_timings_ms),
                            facts=json.loads(json.dumps(d.facts, default=str)))
                for d in profile.devices
            ]
            pv.links = [
                m.LinkRow(src_device_key=l.src_device_id, dst_device_key=l.dst_device_id,
                          bandwidth_gbps=l.bandwidth_gbps, latency_us=l.latency_us, kind=l.kind)
                for l in profile.links
            ]
            s.add(pv)
            s.flush()
            return ProfileVersionInfo(pv.id, cluster.cluster_key, pv.version, pv.source, pv.measured_at)

    def list_profile_versions(self, cluster_key: str | None = None) -> list[ProfileVersionInfo]:
        """All stored profile versions, oldest first (optionally of one cluster)."""
        with self.session() as s:
            q = select(m.ProfileVersion, m.Cluster.cluster_key).join(m.Cluster).order_by(m.ProfileVersion.id)
            if cluster_key is not None:
                q = q.where(m.Cluster.cluster_key == cluster_key)
            return [ProfileVersionInfo(pv.id, key, pv.version, pv.source, pv.measured_at) for pv, key in s.execute(q)]

    def load_profile(self, profile_version_id: int) -> ClusterProfile:
        """Rebuild the :class:`ClusterProfile` of one stored version; ``KeyError`` if absent."""
        with self.session() as s:
            pv = s.get(m.ProfileVersion, profile_version_id,
                       options=[selectinload(m.ProfileVersion.devices), selectinload(m.ProfileVersion.links),
                                selectinload(m.ProfileVersion.cluster)])
            if pv is None:
                raise KeyError(profile_version_id)
            return ClusterProfile(
                cluster_id=pv.cluster.cluster_key, source=pv.source, measured_at=pv.measured_at,
                notes=list(pv.notes),
                devices=[Device(device_id=d.device_key, node_id=d.node_key, model_name=d.model_name,
                                generation=d.generation, kind=d.kind, memory_gib=d.memory_gib,
                                peak_tflops=d.peak_tflops, hbm_bandwidth_gbps=d.hbm_bandwidth_gbps,
                                compute_score=d.compute_score, max_micro_batch=d.max_micro_batch,
                                available_until=d.available_until, op_timings_ms=d.op_timings_ms, facts=d.facts)
                         for d in pv.devices],
                links=[Link(src_device_id=l.src_device_key, dst_device_id=l.dst_device_key,
                            bandwidth_gbps=l.bandwidth_gbps, latency_us=l.latency_us, kind=l.kind)
                       for l in pv.links],
            )

    def latest_profile(self, cluster_key: str | None = None) -> tuple[ProfileVersionInfo, ClusterProfile] | None:
        """The newest profile version (of ``cluster_key``, or of any cluster) or ``None``."""
        versions = self.list_profile_versions(cluster_key)
        if not versions:
            return None
        info = versions[-1]
        return info, self.load_profile(info.id)

    # -- models and gears -----------------------------------------------------------------------
    def save_model(self, name: str, dtype: str, num_layers: int, spec: dict[str, Any]) -> int:
        """Store a model profile once per (name, dtype, spec); return its id."""
        digest = spec_hash(spec)
        with self.session() as s:
            row = s.scalar(select(m.ModelRow).where(m.ModelRow.name == name, m.ModelRow.dtype == dtype,
                                                    m.ModelRow.spec_hash == digest))
            if row is None:
                row = m.ModelRow(name=name, dtype=dtype, spec_hash=digest, num_layers=num_layers, spec=spec)
                s.add(row)
                s.flush()
            return row.id

    def model_ids(self, name: str) -> set[int]:
        """Ids of every stored version of model ``name``."""
        with self.session() as s:
            return set(s.scalars(select(m.ModelRow.id).where(m.ModelRow.name == name)))

    def save_gears(self, gears: Iterable[Gear], profile_version_id: int, model_id: int) -> list[int]:
        """Store gears planned together for a profile version and model as its next plan version.

        The newest plan version is the current candidate set (:meth:`load_gears`); earlier gears stay
        loadable by key (:meth:`load_gear`), e.g. the one still serving. Re-planning a gear with the
        same key moves it into the new plan version. Returns the row ids.
        """
        ids = []
        with self.session() as s:
            last = s.scalar(select(func.max(m.GearRow.plan_version)).where(
                m.GearRow.profile_version_id == profile_version_id, m.GearRow.model_id == model_id))
            plan_version = (last or 0) + 1
            for gear in gears:
                old = s.scalar(select(m.GearRow).where(m.GearRow.gear_key == gear.gear_id,
                                                       m.GearRow.profile_version_id == profile_version_id,
                                                       m.GearRow.model_id == model_id))
                if old is not None:
                    s.delete(old)
                    s.flush()
                row = m.GearRow(
                    gear_key=gear.gear_id, profile_version_id=profile_version_id, model_id=model_id,
                    plan_version=plan_version, kind=gear.kind, micro_batch_size=gear.micro_batch_size,
                    max_inflight_micro_batches=gear.max_inflight_micro_batches,
                    kv_capacity_tokens=gear.kv_capacity_tokens, rps_min=gear.rps_min,
                    rps_max=_finite_or_none(gear.rps_max), target_p99_ms=gear.target_p99_ms,
                    estimate=gear.estimate.model_dump() if gear.estimate else None,
                    spec=gear.model_dump(mode="json"),
                    stages=[m.GearStageRow(stage_index=st.stage_index, layer_start=st.layer_start,
                                           layer_end=st.layer_end, device_keys=list(st.device_ids),
                                           est_stage_ms=st.est_stage_ms, weight_gib=st.weight_gib,
                                           kv_capacity_tokens=st.kv_capacity_tokens)
                            for st in gear.stages],
                )
                s.add(row)
                s.flush()
                ids.append(row.id)
        return ids

    def load_gears(self, profile_version_id: int | None = None, model_id: int | None = None,
                   current_only: bool = True) -> list[Gear]:
        """Gears stored for a profile version and/or model, in insertion order.

        ``current_only``: per (profile version, model), only the newest plan version (the current
        candidate set); False returns every stored gear.
        """
        with self.session() as s:
            q = select(m.GearRow).order_by(m.GearRow.id)
            if profile_version_id is not None:
                q = q.where(m.GearRow.profile_version_id == profile_version_id)
            if model_id is not None:
                q = q.where(m.GearRow.model_id == model_id)
            rows = list(s.scalars(q))
            if current_only:
                newest: dict[tuple[int, int], int] = {}
                for r in rows:
                    key = (r.profile_version_id, r.model_id)
                    newest[key] = max(newest.get(key, 0), r.plan_version)
                rows = [r for r in rows if r.plan_version == newest[(r.profile_version_id, r.model_id)]]
            return [Gear.model_validate(r.spec) for r in rows]

    # -- health ---------------------------------------------------------------------------------
    def mark_unhealthy(self, gear_key: str, cluster_key: str, model_name: str, failure: str, reason: str,
                       run_key: str | None = None) -> int:
        """Tag a gear unhealthy after a failure (OOM, timeout, crashed stage); return the tag id."""
        with self.session() as s:
            tag = m.HealthTag(gear_key=gear_key, cluster_key=cluster_key, model_name=model_name,
                              failure=failure, reason=reason, run_key=run_key)
            s.add(tag)
            s.flush()
            return tag.id

    def unhealthy_gear_keys(self, cluster_key: str | None = None, model_name: str | None = None) -> set[str]:
        """Keys of gears with an uncleared health tag."""
        with self.session() as s:
            q = select(m.HealthTag.gear_key).where(m.HealthTag.cleared_at.is_(None))
            if cluster_key is not None:
                q = q.where(m.HealthTag.cluster_key == cluster_key)
            if model_name is not None:
                q = q.where(m.HealthTag.model_name == model_name)
            return set(s.scalars(q))

    def health_tags(self, include_cleared: bool = False) -> list[m.HealthTag]:
        with self.session() as s:
            q = select(m.HealthTag).order_by(m.HealthTag.id)
            if not include_cleared:
                q = q.where(m.HealthTag.cleared_at.is_(None))
            return list(s.scalars(q))

    def clear_health(self, reason: str, cluster_key: str | None = None, model_name: str | None = None) -> int:
        """Clear open health tags (profile refreshed / model changed); return how many were cleared."""
        with self.session() as s:
            q = update(m.HealthTag).where(m.HealthTag.cleared_at.is_(None))
            if cluster_key is not None:
                q = q.where(m.HealthTag.cluster_key == cluster_key)
            if model_name is not None:
                q = q.where(m.HealthTag.model_name == model_name)
            return s.execute(q.values(cleared_at=m.utcnow(), cleared_reason=reason)).rowcount

    # -- metric samples -------------------------------------------------------------------------
    def write_samples(self, run_key: str, samples: Iterable[MetricSample]) -> int:
        """Append metric samples (one pipeline row + one row per stage each); return rows written."""
        written = 0
        with self.session() as s:
            for smp in samples:
                head = m.MetricSampleRow(
                    run_key=run_key, gear_key=smp.gear_id, source=smp.source, t_s=smp.t_s, scope="pipeline",
                    rps=smp.rps, completed=smp.completed, tokens_per_s=smp.tokens_per_s,
                    queue_length=smp.queue_length, running=smp.running, kv_used_fraction=smp.kv_used_fraction,
                    ttft_p50_ms=smp.ttft_p50_ms, ttft_p99_ms=smp.ttft_p99_ms, tpot_p50_ms=smp.tpot_p50_ms,
                    tpot_p99_ms=smp.tpot_p99_ms, e2e_p50_ms=smp.e2e_p50_ms, e2e_p99_ms=smp.e2e_p99_ms)
                s.add(head)
                s.flush()
                s.add_all(m.MetricSampleRow(
                    run_key=run_key, gear_key=smp.gear_id, source=smp.source, t_s=smp.t_s, scope="stage",
                    parent_id=head.id, stage_index=st.stage_index, busy_fraction=st.busy_fraction,
                    queue_length=st.queue_length, kv_blocks_used=st.kv_blocks_used,
                    kv_blocks_total=st.kv_blocks_total) for st in smp.stages)
                written += 1 + len(smp.stages)
        return written

    def latest_sample_run_key(self) -> str | None:
        """The run that wrote the newest metric sample (the pipeline serving now), or None."""
        with self.session() as s:
            return s.scalar(select(m.MetricSampleRow.run_key).order_by(m.MetricSampleRow.id.desc()).limit(1))

    def read_samples(self, run_key: str | None = None, after_t_s: float | None = None,
                     after_id: int | None = None, limit: int | None = None) -> list[tuple[int, MetricSample]]:
        """Metric samples rebuilt from rows, oldest first, as ``(row_id, sample)`` pairs.

        ``after_id`` lets a sensor read only what arrived since its cursor.
        """
        with self.session() as s:
            q = select(m.MetricSampleRow).where(m.MetricSampleRow.scope == "pipeline")
            if run_key is not None:
                q = q.where(m.MetricSampleRow.run_key == run_key)
            if after_t_s is not None:
                q = q.where(m.MetricSampleRow.t_s > after_t_s)
            if after_id is not None:
                q = q.where(m.MetricSampleRow.id > after_id)
            q = q.order_by(m.MetricSampleRow.id)
            if limit is not None:
                q = q.limit(limit)
            heads = list(s.scalars(q))
            if not heads:
                return []
            stage_rows = s.scalars(select(m.MetricSampleRow).where(
                m.MetricSampleRow.parent_id.in_([h.id for h in heads])).order_by(m.MetricSampleRow.id))
            stages: dict[int, list[StageSample]] = {}
            for r in stage_rows:
                stages.setdefault(r.parent_id, []).append(StageSample(
                    stage_index=r.stage_index, busy_fraction=r.busy_fraction, queue_length=r.queue_length,
                    kv_blocks_used=r.kv_blocks_used, kv_blocks_total=r.kv_blocks_total))
            return [(h.id, MetricSample(
                t_s=h.t_s, gear_id=h.gear_key, source=h.source, rps=h.rps, completed=h.completed,
                tokens_per_s=h.tokens_per_s, queue_length=h.queue_length, running=h.running,
                kv_used_fraction=h.kv_used_fraction, ttft_p50_ms=h.ttft_p50_ms, ttft_p99_ms=h.ttft_p99_ms,
                tpot_p50_ms=h.tpot_p50_ms, tpot_p99_ms=h.tpot_p99_ms, e2e_p50_ms=h.e2e_p50_ms,
                e2e_p99_ms=h.e2e_p99_ms, stages=tuple(stages.get(h.id, ()))))
                for h in heads]

    # -- shift events ---------------------------------------------------------------------------
    def record_shift_event(self, action: str, status: str, reason: str, *, from_gear_key: str | None = None,
                           to_gear_key: str | None = None, trigger: str | None = None,
                           est_gain: float | None = None, migration_cost_s: float | None = None,
                           run_key: str | None = None, details: dict[str, Any] | None = None) -> int:
        """Record a controller decision or a shift's outcome; return the event id."""
        with self.session() as s:
            ev = m.ShiftEvent(action=action, status=status, reason=reason, from_gear_key=from_gear_key,
                              to_gear_key=to_gear_key, trigger=trigger, est_gain=_finite_or_none(est_gain),
                              migration_cost_s=_finite_or_none(migration_cost_s), run_key=run_key,
                              details=json.loads(json.dumps(details or {}, default=str)))
            s.add(ev)
            s.flush()
            return ev.id

    def update_shift_event(self, event_id: int, status: str, details: dict[str, Any] | None = None) -> None:
        with self.session() as s:
            ev = s.get(m.ShiftEvent, event_id)
            if ev is None:
                raise KeyError(event_id)
            ev.status = status
            if details:
                ev.details = {**ev.details, **json.loads(json.dumps(details, default=str))}

    def get_shift_event(self, event_id: int) -> m.ShiftEvent:
        with self.session() as s:
            ev = s.get(m.ShiftEvent, event_id)
            if ev is None:
                raise KeyError(event_id)
            return ev

    def pending_shift_requests(self) -> list[m.ShiftEvent]:
        """Shifts a Dagster run asked the live pipeline to make (status ``requested``), oldest first."""
        with self.session() as s:
            return list(s.scalars(select(m.ShiftEvent).where(m.ShiftEvent.status == "requested")
                                  .order_by(m.ShiftEvent.id)))

    def load_gear(self, gear_key: str) -> Gear | None:
        """The most recently stored gear with this key, or None."""
        with self.session() as s:
            row = s.scalar(select(m.GearRow).where(m.GearRow.gear_key == gear_key).order_by(m.GearRow.id.desc()))
            return Gear.model_validate(row.spec) if row else None

    def shift_events(self, limit: int | None = None) -> list[m.ShiftEvent]:
        with self.session() as s:
            q = select(m.ShiftEvent).order_by(m.ShiftEvent.id)
            if limit is not None:
                q = q.limit(limit)
            return list(s.scalars(q))

    # -- inference jobs -------------------------------------------------------------------------
    def get_or_create_job(self, job_key: str, kind: str = "batch", *, priority: int = 0,
                          source_path: str | None = None, gear_key: str | None = None,
                          config: dict[str, Any] | None = None) -> int:
        """The id of job ``job_key``, creating it (status ``queued``) if new; ``config`` relaunches it."""
        with self.session() as s:
            job = s.scalar(select(m.InferenceJob).where(m.InferenceJob.job_key == job_key))
            if job is None:
                job = m.InferenceJob(job_key=job_key, kind=kind, status="queued", priority=priority,
                                     source_path=source_path, gear_key=gear_key, config=dict(config or {}))
                s.add(job)
                s.flush()
            return job.id

    def update_job(self, job_id: int, **fields: Any) -> None:
        """Set columns of a job (status, total_requests, malformed_rows, error, gear_key)."""
        with self.session() as s:
            job = s.get(m.InferenceJob, job_id)
            if job is None:
                raise KeyError(job_id)
            for k, v in fields.items():
                setattr(job, k, v)

    def job_status(self, job_id: int) -> str:
        with self.session() as s:
            job = s.get(m.InferenceJob, job_id)
            if job is None:
                raise KeyError(job_id)
            return job.status

    def jobs(self, status: str | None = None, kind: str | None = None) -> list[m.InferenceJob]:
        with self.session() as s:
            q = select(m.InferenceJob).order_by(m.InferenceJob.priority.desc(), m.InferenceJob.id)
            if status is not None:
                q = q.where(m.InferenceJob.status == status)
            if kind is not None:
                q = q.where(m.InferenceJob.kind == kind)
            return list(s.scalars(q))

    def write_result(self, job_id: int, request_key: str, *, prompt_tokens: int, output_token_ids: list[int],
                     status: str = "done", gear_key: str | None = None, output_text: str | None = None,
                     ttft_ms: float | None = None, tpot_ms: float | None = None,
                     e2e_ms: float | None = None) -> bool:
        """Write one request's result idempotently; returns False if it was already stored."""
        try:
            return self._insert_result(job_id, request_key, prompt_tokens, output_token_ids, status, gear_key,
                                       output_text, ttft_ms, tpot_ms, e2e_ms)
        except IntegrityError:  # a concurrent writer stored the same request first
            return False

    def _insert_result(self, job_id, request_key, prompt_tokens, output_token_ids, status, gear_key,
                       output_text, ttft_ms, tpot_ms, e2e_ms) -> bool:
        with self.session() as s:
            exists = s.scalar(select(m.RequestResult.id).where(m.RequestResult.job_id == job_id,
                                                               m.RequestResult.request_key == request_key))
            if exists is not None:
                return False
            s.add(m.RequestResult(job_id=job_id, request_key=request_key, status=status, gear_key=gear_key,
                                  prompt_tokens=prompt_tokens, output_tokens=len(output_token_ids),
                                  output_token_ids=list(output_token_ids), output_text=output_text,
                                  ttft_ms=ttft_ms, tpot_ms=tpot_ms, e2e_ms=e2e_ms))
            return True

    def done_request_keys(self, job_id: int) -> set[str]:
        with self.session() as s:
            return set(s.scalars(select(m.RequestResult.request_key).where(
                m.RequestResult.job_id == job_id, m.RequestResult.status == "done")))

    def results(self, job_id: int) -> list[m.RequestResult]:
        with self.session() as s:
            return list(s.scalars(select(m.RequestResult).where(m.RequestResult.job_id == job_id)
                                  .order_by(m.RequestResult.id)))

    # -- calibration: observed stage steps and calibration versions ---------------------------------
    _OBS_FIELDS = ("stage_index", "is_first", "is_last", "layer_start", "layer_end", "kind", "num_seqs",
                   "prefill_seqs", "prompt_tokens", "decode_tokens", "kv_context_tokens", "attended_pairs",
                   "wall_ms", "send_ms", "send_bytes", "mb_id", "t_s")

    def write_observations(self, run_key: str, observations: Iterable[Any], cluster_key: str | None = None) -> int:
        """Append observed stage steps (:class:`~flexpipe_dag.calibration.observation.StageObservation`) of a run."""
        def plain(f: str, v: Any) -> Any:  # numpy scalars -> Python (psycopg2 cannot adapt them)
            if v is None or f == "kind":
                return v
            if f in ("is_first", "is_last"):
                return bool(v)
            return float(v) if f in ("wall_ms", "send_ms", "t_s") else int(v)

        rows = [m.StageObservationRow(run_key=run_key, gear_key=o.gear_id, cluster_key=cluster_key,
                                      device_key=o.device_id, dst_device_key=o.dst_device_id,
                                      **{f: plain(f, getattr(o, f)) for f in self._OBS_FIELDS})
                for o in observations]
        with self.session() as s:
            s.add_all(rows)
        return len(rows)

    def read_observations(self, run_key: str | None = None, gear_key: str | None = None,
                          cluster_key: str | None = None) -> list[Any]:
        """Stored stage steps (oldest first), optionally of one run / gear / cluster, as ``StageObservation``."""
        from flexpipe_dag.calibration.observation import StageObservation

        q = select(m.StageObservationRow).order_by(m.StageObservationRow.id)
        if run_key is not None:
            q = q.where(m.StageObservationRow.run_key == run_key)
        if gear_key is not None:
            q = q.where(m.StageObservationRow.gear_key == gear_key)
        if cluster_key is not None:
            q = q.where(m.StageObservationRow.cluster_key == cluster_key)
        with self.session() as s:
            return [StageObservation(gear_id=r.gear_key, device_id=r.device_key, dst_device_id=r.dst_device_key,
                                     **{f: getattr(r, f) for f in self._OBS_FIELDS}) for r in s.scalars(q)]

    def observed_runs(self) -> list[dict[str, Any]]:
        """One row per (run, gear) with stored observations: ``run_key, gear_key, cluster_key, steps``."""
        r = m.StageObservationRow
        q = (select(r.run_key, r.gear_key, r.cluster_key, func.count(r.id), func.min(r.id))
             .group_by(r.run_key, r.gear_key, r.cluster_key).order_by(func.min(r.id)))
        with self.session() as s:
            return [{"run_key": a, "gear_key": b, "cluster_key": c, "steps": n} for a, b, c, n, _ in s.execute(q)]

    def save_calibration(self, profile_version_id: int, calibration: Any, run_keys: Iterable[str] = ()) -> tuple[int, int]:
        """Store a :class:`~flexpipe_dag.calibration.Calibration` as the next calibration version of a
        profile version (the profile's device and link rows are not touched); returns ``(id, version)``.

        Raises:
            KeyError: no such profile version.
        """
        with self.session() as s:
            if s.get(m.ProfileVersion, profile_version_id) is None:
                raise KeyError(profile_version_id)
            last = s.scalar(select(func.max(m.CalibrationRow.version))
                            .where(m.CalibrationRow.profile_version_id == profile_version_id))
            row = m.CalibrationRow(profile_version_id=profile_version_id, version=(last or 0) + 1,
                                   model_name=calibration.model_name, dtype=calibration.dtype,
                                   num_observations=calibration.num_observations, run_keys=list(run_keys),
                                   changed_devices=calibration.changed_devices(), summary=calibration.summary_lines(),
                                   document=json.loads(json.dumps(calibration.to_dict(), default=str)))
            s.add(row)
            s.flush()
            return row.id, row.version

    def calibrations(self, profile_version_id: int | None = None) -> list[m.CalibrationRow]:
        """Stored calibration rows, oldest first (optionally of one profile version)."""
        q = select(m.CalibrationRow).order_by(m.CalibrationRow.id)
        if profile_version_id is not None:
            q = q.where(m.CalibrationRow.profile_version_id == profile_version_id)
        with self.session() as s:
            return list(s.scalars(q))

    def latest_calibration(self, profile_version_id: int, model_name: str | None = None,
                           dtype: str | None = None) -> Any | None:
        """The newest :class:`~flexpipe_dag.calibration.Calibration` of a profile version (or ``None``)."""
        from flexpipe_dag.calibration.calibrate import Calibration

        q = (select(m.CalibrationRow).where(m.CalibrationRow.profile_version_id == profile_version_id)
             .order_by(m.CalibrationRow.version.desc()).limit(1))
        if model_name is not None:
            q = q.where(m.CalibrationRow.model_name == model_name)
        if dtype is not None:
            q = q.where(m.CalibrationRow.dtype == dtype)
        with self.session() as s:
            row = s.scalar(q)
            return None if row is None else Calibration.from_dict(row.document)
