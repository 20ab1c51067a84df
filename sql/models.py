"""SQLAlchemy 2.0 typed models of the FlexPipe store.

One schema serves SQLite (embedded default) and PostgreSQL. Constraint names follow a fixed naming
convention so Alembic migrations are stable on both. ``*_key`` columns hold the user-facing ids
(device ids, gear ids, request ids); ``id`` columns are surrogate keys. Status, action and source
columns hold the values of the enums in :mod:`flexpipe_dag.core.status`; their comments list them.

Tables: clusters, profile_versions, devices, links, hosts, network_tiers, models, gears, gear_stages, health_tags,
metric_samples, pipeline_runs, shift_events, inference_jobs, request_results, stage_observations,
calibrations.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from flexpipe_dag.core.status import (
    HealthFailure,
    InferenceJobKind,
    InferenceJobStatus,
    PipelineRunKind,
    RequestResultStatus,
    SampleSource,
    ShiftEventAction,
    ShiftEventStatus,
    column_comment,
)

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, dt.datetime: DateTime(timezone=True)}


class Cluster(Base):
    __tablename__ = "clusters"
    id: Mapped[int] = mapped_column(primary_key=True)
    cluster_key: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    versions: Mapped[list[ProfileVersion]] = relationship(back_populates="cluster", order_by="ProfileVersion.version")


class ProfileVersion(Base):
    """One measurement (or declaration) of a cluster; never updated, only superseded."""

    __tablename__ = "profile_versions"
    __table_args__ = (UniqueConstraint("cluster_id", "version"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    source: Mapped[str] = mapped_column(String(40))
    measured_at: Mapped[dt.datetime]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    notes: Mapped[list[Any]] = mapped_column(default=list)
    cluster: Mapped[Cluster] = relationship(back_populates="versions")
    devices: Mapped[list[DeviceRow]] = relationship(cascade="all, delete-orphan", order_by="DeviceRow.id")
    links: Mapped[list[LinkRow]] = relationship(cascade="all, delete-orphan", order_by="LinkRow.id")
    hosts: Mapped[list[HostRow]] = relationship(cascade="all, delete-orphan", order_by="HostRow.id")
    network_tiers: Mapped[list[NetworkTierRow]] = relationship(cascade="all, delete-orphan",
                                                                order_by="NetworkTierRow.id")


class DeviceRow(Base):
    __tablename__ = "devices"
    __table_args__ = (UniqueConstraint("profile_version_id", "device_key"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    profile_version_id: Mapped[int] = mapped_column(ForeignKey("profile_versions.id", ondelete="CASCADE"), index=True)
    device_key: Mapped[str] = mapped_column(String(200))
    node_key: Mapped[str] = mapped_column(String(200))
    model_name: Mapped[str] = mapped_column(String(200))
    generation: Mapped[str | None] = mapped_column(String(100))
    kind: Mapped[str] = mapped_column(String(20))
    memory_gib: Mapped[float] = mapped_column(Float)
    peak_tflops: Mapped[float] = mapped_column(Float)
    hbm_bandwidth_gbps: Mapped[float] = mapped_column(Float)
    compute_score: Mapped[float] = mapped_column(Float)
    max_micro_batch: Mapped[int | None]
    available_until: Mapped[dt.datetime | None]
    bf16: Mapped[bool | None] = mapped_column(comment="runs bf16 (compute capability >= 8.0); NULL: unknown")
    op_timings_ms: Mapped[dict[str, Any]] = mapped_column(default=dict)
    facts: Mapped[dict[str, Any]] = mapped_column(default=dict)


class LinkRow(Base):
    __tablename__ = "links"
    __table_args__ = (UniqueConstraint("profile_version_id", "src_device_key", "dst_device_key"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    profile_version_id: Mapped[int] = mapped_column(ForeignKey("profile_versions.id", ondelete="CASCADE"), index=True)
    src_device_key: Mapped[str] = mapped_column(String(200))
    dst_device_key: Mapped[str] = mapped_column(String(200))
    bandwidth_gbps: Mapped[float] = mapped_column(Float)
    latency_us: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(40))


class HostRow(Base):
    """A host of a profile version's topology: its rack and its intra-host link figures."""

    __tablename__ = "hosts"
    __table_args__ = (UniqueConstraint("profile_version_id", "host_key"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    profile_version_id: Mapped[int] = mapped_column(ForeignKey("profile_versions.id", ondelete="CASCADE"), index=True)
    host_key: Mapped[str] = mapped_column(String(200))
    rack_key: Mapped[str | None] = mapped_column(String(200), comment="rack of the host; NULL: the one default rack")
    intra_kind: Mapped[str] = mapped_column(String(40))
    intra_bandwidth_gbps: Mapped[float] = mapped_column(Float)
    intra_latency_us: Mapped[float] = mapped_column(Float)


class NetworkTierRow(Base):
    """A network tier between the hosts of a profile version's topology (``inter_node``, ``inter_rack``)."""

    __tablename__ = "network_tiers"
    __table_args__ = (UniqueConstraint("profile_version_id", "tier"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    profile_version_id: Mapped[int] = mapped_column(ForeignKey("profile_versions.id", ondelete="CASCADE"), index=True)
    tier: Mapped[str] = mapped_column(String(20), comment="inter_node (hosts of one rack) or inter_rack")
    bandwidth_gbps: Mapped[float] = mapped_column(Float)
    latency_us: Mapped[float] = mapped_column(Float)
    oversubscription: Mapped[float] = mapped_column(Float)


class ModelRow(Base):
    """A model profile (ModelSpec as JSON); a new ``spec_hash`` means the model changed."""

    __tablename__ = "models"
    __table_args__ = (UniqueConstraint("name", "dtype", "spec_hash"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    dtype: Mapped[str] = mapped_column(String(20))
    spec_hash: Mapped[str] = mapped_column(String(64))
    num_layers: Mapped[int]
    spec: Mapped[dict[str, Any]]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class GearRow(Base):
    __tablename__ = "gears"
    __table_args__ = (UniqueConstraint("gear_key", "profile_version_id", "model_id"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    gear_key: Mapped[str] = mapped_column(String(200), index=True)
    profile_version_id: Mapped[int] = mapped_column(ForeignKey("profile_versions.id", ondelete="CASCADE"))
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    plan_version: Mapped[int] = mapped_column(default=1, server_default="1",
                                              comment="gears planned together share one; the newest is the current set")
    kind: Mapped[str] = mapped_column(String(20))
    micro_batch_size: Mapped[int]
    max_inflight_micro_batches: Mapped[int]
    kv_capacity_tokens: Mapped[int]
    rps_min: Mapped[float] = mapped_column(Float)
    rps_max: Mapped[float | None] = mapped_column(Float, comment="NULL = unbounded")
    target_p99_ms: Mapped[float] = mapped_column(Float)
    estimate: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    spec: Mapped[dict[str, Any]]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    stages: Mapped[list[GearStageRow]] = relationship(cascade="all, delete-orphan", order_by="GearStageRow.stage_index")


class GearStageRow(Base):
    __tablename__ = "gear_stages"
    __table_args__ = (UniqueConstraint("gear_id", "stage_index"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    gear_id: Mapped[int] = mapped_column(ForeignKey("gears.id", ondelete="CASCADE"))
    stage_index: Mapped[int]
    layer_start: Mapped[int]
    layer_end: Mapped[int]
    device_keys: Mapped[list[Any]]
    est_stage_ms: Mapped[float | None] = mapped_column(Float)
    weight_gib: Mapped[float | None] = mapped_column(Float)
    kv_capacity_tokens: Mapped[int | None]


class HealthTag(Base):
    """A gear marked unhealthy after a failure; cleared by a profile refresh or a model change."""

    __tablename__ = "health_tags"
    id: Mapped[int] = mapped_column(primary_key=True)
    gear_key: Mapped[str] = mapped_column(String(200), index=True)
    cluster_key: Mapped[str] = mapped_column(String(200))
    model_name: Mapped[str] = mapped_column(String(200))
    failure: Mapped[str] = mapped_column(String(40), comment=column_comment(HealthFailure))
    reason: Mapped[str] = mapped_column(Text)
    run_key: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    cleared_at: Mapped[dt.datetime | None]
    cleared_reason: Mapped[str | None] = mapped_column(Text)


class MetricSampleRow(Base):
    """One metric sample: ``scope='pipeline'`` (stage_index NULL) or ``scope='stage'``."""

    __tablename__ = "metric_samples"
    __table_args__ = (Index("ix_metric_samples_run_key_t_s", "run_key", "t_s"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_key: Mapped[str] = mapped_column(String(200))
    gear_key: Mapped[str] = mapped_column(String(200))
    source: Mapped[str] = mapped_column(String(10), comment=column_comment(SampleSource))
    t_s: Mapped[float] = mapped_column(Float)
    scope: Mapped[str] = mapped_column(String(10))
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("metric_samples.id", ondelete="CASCADE"), index=True,
                                                  comment="the pipeline row a stage row belongs to")
    stage_index: Mapped[int | None]
    rps: Mapped[float | None] = mapped_column(Float)
    completed: Mapped[int | None]
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    queue_length: Mapped[int | None]
    running: Mapped[int | None]
    kv_used_fraction: Mapped[float | None] = mapped_column(Float)
    ttft_p50_ms: Mapped[float | None] = mapped_column(Float)
    ttft_p99_ms: Mapped[float | None] = mapped_column(Float)
    tpot_p50_ms: Mapped[float | None] = mapped_column(Float)
    tpot_p99_ms: Mapped[float | None] = mapped_column(Float)
    e2e_p50_ms: Mapped[float | None] = mapped_column(Float)
    e2e_p99_ms: Mapped[float | None] = mapped_column(Float)
    busy_fraction: Mapped[float | None] = mapped_column(Float)
    kv_blocks_used: Mapped[int | None]
    kv_blocks_total: Mapped[int | None]
    instances: Mapped[int | None] = mapped_column(
        comment="pipeline instances of the gear whose windows a pipeline row sums (rates and counts are theirs "
                "together); NULL: 1 (stage rows, rows stored before it existed)")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)  # the retention prunes by it


class ShiftEvent(Base):
    """A controller decision (taken or declined) and, when taken, how the shift went."""

    __tablename__ = "shift_events"
    id: Mapped[int] = mapped_column(primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    action: Mapped[str] = mapped_column(String(20), comment=column_comment(ShiftEventAction))
    status: Mapped[str] = mapped_column(String(20), comment=column_comment(ShiftEventStatus))
    from_gear_key: Mapped[str | None] = mapped_column(String(200))
    to_gear_key: Mapped[str | None] = mapped_column(String(200))
    trigger: Mapped[str | None] = mapped_column(String(40))
    reason: Mapped[str] = mapped_column(Text)
    est_gain: Mapped[float | None] = mapped_column(Float)
    migration_cost_s: Mapped[float | None] = mapped_column(Float)
    run_key: Mapped[str | None] = mapped_column(String(200))
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)
    decision_key: Mapped[str | None] = mapped_column(
        String(200), unique=True, comment="the decision's deterministic key (a shift's gear_shift run key): one "
                                          "decision, one row, whatever the retries; NULL: an event without one")
    expires_at: Mapped[dt.datetime | None] = mapped_column(
        comment="a requested shift that no live serving run took by then expires; NULL: no deadline")


class PipelineRun(Base):
    """A run that writes metric samples (serving run or batch job): whether it is live, and since when."""

    __tablename__ = "pipeline_runs"
    id: Mapped[int] = mapped_column(primary_key=True)
    run_key: Mapped[str] = mapped_column(String(200), unique=True, comment="metric_samples.run_key of its samples")
    kind: Mapped[str] = mapped_column(String(20), comment=column_comment(PipelineRunKind))
    gear_key: Mapped[str | None] = mapped_column(String(200), comment="the gear serving at the last heartbeat")
    inline_control: Mapped[bool] = mapped_column(
        default=False, server_default=false(),
        comment="the run decides its own shifts (serve loop with inline control): the gear_shift_sensor leaves it alone")
    started_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[dt.datetime | None] = mapped_column(comment="NULL while the run is live")
    endpoint: Mapped[str | None] = mapped_column(
        String(300), comment="base URL clients reach the run at (a front door's .../v1); NULL: a run without an API")


class InferenceJob(Base):
    __tablename__ = "inference_jobs"
    # a server's batch runner polls the batches of runnable statuses every half second, and GET /v1/batches pages
    # them newest first: both found without reading the weeks of finished ones
    __table_args__ = (Index("ix_inference_jobs_kind_status", "kind", "status"),
                      Index("ix_inference_jobs_kind_id", "kind", "id"))
    id: Mapped[int] = mapped_column(primary_key=True)
    job_key: Mapped[str] = mapped_column(String(200), unique=True)
    kind: Mapped[str] = mapped_column(String(20), comment=column_comment(InferenceJobKind))
    status: Mapped[str] = mapped_column(String(20), comment=column_comment(InferenceJobStatus))
    priority: Mapped[int] = mapped_column(default=0)
    source_path: Mapped[str | None] = mapped_column(Text)
    gear_key: Mapped[str | None] = mapped_column(String(200))
    config: Mapped[dict[str, Any]] = mapped_column(default=dict, server_default="{}",
                                                   comment="run config that (re)launches the job")
    total_requests: Mapped[int] = mapped_column(default=0)
    malformed_rows: Mapped[int] = mapped_column(default=0)
    error: Mapped[str | None] = mapped_column(Text)
    admissions: Mapped[int] = mapped_column(default=0, server_default="0",
                                            comment="times the tide sensor admitted the job (numbers its run keys)")
    owner_run_key: Mapped[str | None] = mapped_column(
        String(200), comment="the serving run that serves this Batch API batch (NULL: not claimed yet); another "
                             "server takes it over once that run has ended or fallen silent")
    expires_at: Mapped[dt.datetime | None] = mapped_column(
        comment="a Batch API batch: the end of its completion window; one that has not ended by then expires (its "
                "unserved lines answered batch_expired); NULL: no deadline")
    results_expire_at: Mapped[dt.datetime | None] = mapped_column(
        index=True, comment="a Batch API batch that has ended: when its output and error files expire and a prune "
                            "deletes its result rows (their counts kept); NULL: not ended, or not such a batch")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    results: Mapped[list[RequestResult]] = relationship(back_populates="job", cascade="all, delete-orphan")


class RequestResult(Base):
    """One finished request; unique per (job, request_key) so writes are idempotent."""

    __tablename__ = "request_results"
    __table_args__ = (UniqueConstraint("job_id", "request_key"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("inference_jobs.id", ondelete="CASCADE"), index=True)
    request_key: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20), comment=column_comment(RequestResultStatus))
    gear_key: Mapped[str | None] = mapped_column(String(200))
    prompt_tokens: Mapped[int]
    output_tokens: Mapped[int]
    output_token_ids: Mapped[list[Any]]
    output_text: Mapped[str | None] = mapped_column(Text)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    tpot_ms: Mapped[float | None] = mapped_column(Float)
    e2e_ms: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    job: Mapped[InferenceJob] = relationship(back_populates="results")


class StageObservationRow(Base):
    """One observed micro-batch step of one stage (runtime -> calibration); raw evidence, never updated."""

    __tablename__ = "stage_observations"
    __table_args__ = (Index("ix_stage_observations_run_key_t_s", "run_key", "t_s"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_key: Mapped[str] = mapped_column(String(200))
    gear_key: Mapped[str] = mapped_column(String(200), index=True)
    cluster_key: Mapped[str | None] = mapped_column(String(200))
    stage_index: Mapped[int]
    device_key: Mapped[str] = mapped_column(String(200), index=True)
    dst_device_key: Mapped[str | None] = mapped_column(String(200))
    is_first: Mapped[bool]
    is_last: Mapped[bool]
    layer_start: Mapped[int]
    layer_end: Mapped[int]
    kind: Mapped[str] = mapped_column(String(10), comment="prefill | decode | mixed")
    num_seqs: Mapped[int]
    prefill_seqs: Mapped[int]
    prompt_tokens: Mapped[int]
    decode_tokens: Mapped[int]
    kv_context_tokens: Mapped[int]
    attended_pairs: Mapped[int] = mapped_column(BigInteger)
    wall_ms: Mapped[float] = mapped_column(Float)
    send_ms: Mapped[float | None] = mapped_column(Float, comment="sender-side hand-off to the next stage")
    send_bytes: Mapped[int] = mapped_column(BigInteger)
    mb_id: Mapped[int] = mapped_column(BigInteger)
    t_s: Mapped[float] = mapped_column(Float)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class CalibrationRow(Base):
    """A calibration version beside the profile version it refines (the profile's rows stay as measured)."""

    __tablename__ = "calibrations"
    __table_args__ = (UniqueConstraint("profile_version_id", "version"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    profile_version_id: Mapped[int] = mapped_column(ForeignKey("profile_versions.id", ondelete="CASCADE"), index=True)
    version: Mapped[int]
    model_name: Mapped[str] = mapped_column(String(200))
    dtype: Mapped[str] = mapped_column(String(20))
    num_observations: Mapped[int]
    run_keys: Mapped[list[Any]] = mapped_column(default=list)
    changed_devices: Mapped[list[Any]] = mapped_column(default=list)
    summary: Mapped[list[Any]] = mapped_column(default=list)
    document: Mapped[dict[str, Any]] = mapped_column(comment="flexpipe_dag.calibration.Calibration.to_dict()")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class ApiFile(Base):
    """A file uploaded through the front door's ``POST /v1/files`` (OpenAI Files API; purpose ``batch``)."""

    __tablename__ = "api_files"
    __table_args__ = (Index("ix_api_files_created_at_id", "created_at", "id"),)  # GET /v1/files pages by them
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    purpose: Mapped[str] = mapped_column(String(20))
    filename: Mapped[str] = mapped_column(String(255))
    content: Mapped[bytes] = mapped_column(LargeBinary)
    bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[dt.datetime | None] = mapped_column(
        default=None, index=True, comment="when the file is no longer served and may be pruned; NULL: kept until deleted")
    deleted_at: Mapped[dt.datetime | None] = mapped_column(
        default=None, comment="when DELETE /v1/files took it (its content is gone; the row stays a while as a list "
                              "cursor); NULL: not deleted")
