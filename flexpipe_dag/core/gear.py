"""A gear: one complete, runnable pipeline configuration, and its estimated behaviour.

A gear assigns contiguous layer ranges (``[layer_start, layer_end)``, 0-based decoder layers) to
stages; each stage runs on one device, or on ``replicas`` > 1 devices as data-parallel copies of a
hot stage. The embedding is charged to the first stage, final norm + LM head to the last.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

from flexpipe_dag.core.dtypes import canonical_dtype
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.ids import MAX_ID_CHARS, Identifier

GearKind = Literal["latency", "balanced", "throughput", "uniform", "parameters", "oracle", "manual"]
#: The three operating gears the planner proposes (baselines use the other kinds).
OPERATING_KINDS: tuple[GearKind, ...] = ("latency", "balanced", "throughput")


#: Ceilings of a gear's figures (documented limits; far above any real gear, low enough that a typo or a
#: hostile file cannot size a buffer of 1e18 entries).
MAX_MICRO_BATCH_SIZE = 65536
MAX_INFLIGHT_MICRO_BATCHES = 4096
MAX_KV_BLOCK_SIZE_TOKENS = 65536
#: Most decoder layers (and so stages' layer indices) a gear may name.
MAX_GEAR_LAYERS = 65536
#: Most KV tokens a gear or stage may reserve (2**40, about 1.1e12).
MAX_KV_CAPACITY_TOKENS = 2**40


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StagePlan(_Model):
    """One pipeline stage: a contiguous layer range on one device (or on several replicas)."""

    stage_index: Annotated[int, Field(ge=0, le=MAX_GEAR_LAYERS)]
    layer_start: Annotated[int, Field(ge=0, le=MAX_GEAR_LAYERS)]
    layer_end: Annotated[int, Field(ge=1, le=MAX_GEAR_LAYERS)] = Field(description="exclusive")
    device_ids: list[Identifier] = Field(min_length=1, max_length=4096, description="one per replica")
    est_stage_ms: float | None = Field(None, ge=0, description="estimated time per micro-batch step, ms (finite)")
    weight_gib: float | None = Field(None, ge=0, description="weights held, GiB (finite)")
    kv_capacity_tokens: int | None = Field(None, ge=0, le=MAX_KV_CAPACITY_TOKENS)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def replicas(self) -> int:
        return len(self.device_ids)


class GearEstimate(_Model):
    """What the cost model and simulator expect a gear to do at its operating envelope."""

    throughput_rps: float = Field(ge=0)
    tokens_per_s: float = Field(ge=0)
    ttft_p50_ms: float = Field(ge=0)
    ttft_p99_ms: float = Field(ge=0)
    tpot_p50_ms: float = Field(ge=0)
    tpot_p99_ms: float = Field(ge=0)
    bottleneck_stage: int = Field(ge=0)


class EnvelopeBasis(_Model):
    """What a gear's envelope (``rps_min..rps_max``) was measured against: the promise's fine print.

    ``rps_max`` is the highest mean arrival rate of ``workload`` (its first ``num_requests``
    requests, time-compressed, burstiness and lengths kept) at which at least ``attainment`` of the
    requests after the warm-up meet TTFT <= ``slo_ttft_ms`` and TPOT <= ``slo_tpot_ms`` and none is
    lost, as measured by ``source``: ``"simulator"`` (the discrete-event simulator, the planner's
    default) or ``"analytic"`` (the closed-form estimate only).
    """

    source: Literal["simulator", "analytic"]
    slo_ttft_ms: float = Field(gt=0)
    slo_tpot_ms: float = Field(gt=0)
    attainment: float = Field(gt=0, le=1)
    workload: str = Field(min_length=1, description="trace name or path the rate was measured on")
    num_requests: int = Field(ge=2, description="requests of the trace replayed per probe")

    def describe(self) -> str:
        """One line for tables and logs, e.g. ``95 % within TTFT 2000 ms / TPOT 200 ms on azure-conv (simulator)``."""
        return (f"{self.attainment:.0%} within TTFT {self.slo_ttft_ms:g} ms / TPOT {self.slo_tpot_ms:g} ms "
                f"on {self.workload} ({self.source})")


class Gear(_Model):
    """A complete pipeline configuration plus its operating envelope.

    Bounds: ``micro_batch_size`` 1..:data:`MAX_MICRO_BATCH_SIZE`, ``max_inflight_micro_batches``
    1..:data:`MAX_INFLIGHT_MICRO_BATCHES`, ``kv_block_size_tokens`` 1..:data:`MAX_KV_BLOCK_SIZE_TOKENS`,
    ``num_layers`` 1..:data:`MAX_GEAR_LAYERS`, KV capacities 0..:data:`MAX_KV_CAPACITY_TOKENS` tokens; every
    estimate (ms, GiB, rps) finite and >= 0 (only ``rps_max`` may be unbounded).

    Validation: stages are numbered 0..n-1, cover ``[0, num_layers)`` contiguously, none is empty,
    and no device serves two stages.
    """

    gear_id: Identifier
    kind: GearKind
    model_name: str = Field(max_length=MAX_ID_CHARS)
    dtype: str = "bf16"
    num_layers: Annotated[int, Field(ge=1, le=MAX_GEAR_LAYERS)]
    stages: list[StagePlan] = Field(min_length=1, max_length=4096)
    micro_batch_size: Annotated[int, Field(ge=1, le=MAX_MICRO_BATCH_SIZE)] = 1
    max_inflight_micro_batches: Annotated[int, Field(ge=1, le=MAX_INFLIGHT_MICRO_BATCHES)] = 1
    kv_block_size_tokens: Annotated[int, Field(ge=1, le=MAX_KV_BLOCK_SIZE_TOKENS)] = 16
    kv_capacity_tokens: Annotated[int, Field(ge=0, le=MAX_KV_CAPACITY_TOKENS)] = 0
    # Gears saved before the request rate was named rps_* spell it qps_*: both read.
    rps_min: float = Field(0.0, ge=0, validation_alias=AliasChoices("rps_min", "qps_min"))
    rps_max: float = Field(float("inf"), ge=0, allow_inf_nan=True, validation_alias=AliasChoices("rps_max", "qps_max"))
    target_p99_ms: float = Field(1000.0, gt=0)
    estimate: GearEstimate | None = None
    cluster_id: Identifier | None = None
    profile_version: int | None = None
    envelope_basis: EnvelopeBasis | None = Field(None, description="the SLO and workload rps_min..rps_max hold for")

    @model_validator(mode="before")
    @classmethod
    def _one_name_per_rate(cls, data: object) -> object:
        """``qps_min`` / ``qps_max`` (the names before ``rps``) read too, but not beside the new ones."""
        if isinstance(data, dict):
            for old, new in (("qps_min", "rps_min"), ("qps_max", "rps_max")):
                if old in data and new in data:
                    raise ValueError(f"{old} (the old name) and {new} are both given; keep {new}")
        return data

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        """A dtype of the one table (:mod:`flexpipe_dag.core.dtypes`), stored by its canonical name."""
        try:
            return canonical_dtype(value)
        except InputError as exc:
            raise ValueError(exc.problem) from None

    @field_validator("rps_max", mode="before")
    @classmethod
    def _unbounded(cls, value: object) -> object:
        """JSON has no Infinity: ``null`` (or a missing value) means an unbounded envelope."""
        return float("inf") if value is None else value

    @field_serializer("rps_max", when_used="json")
    def _rps_max_json(self, value: float) -> float | None:
        return None if value == float("inf") else value

    @model_validator(mode="after")
    def _check_stages(self) -> Gear:
        expected_start = 0
        used: set[str] = set()
        for i, st in enumerate(self.stages):
            if st.stage_index != i:
                raise ValueError(f"stages[{i}].stage_index: expected {i}, got {st.stage_index}")
            if st.layer_start != expected_start:
                raise ValueError(f"stages[{i}].layer_start: expected {expected_start} (contiguous), got {st.layer_start}")
            if st.layer_end <= st.layer_start:
                raise ValueError(f"stages[{i}]: empty stage [{st.layer_start}, {st.layer_end})")
            if len(set(st.device_ids)) != len(st.device_ids):
                raise ValueError(f"stages[{i}].device_ids: a device is listed twice in this stage "
                                 f"(one device per replica): {list(st.device_ids)}")
            for d in st.device_ids:
                if d in used:
                    raise ValueError(f"stages[{i}].device_ids: device {d!r} already serves another stage")
                used.add(d)
            expected_start = st.layer_end
        if expected_start != self.num_layers:
            raise ValueError(f"stages: cover layers [0, {expected_start}), model has {self.num_layers}")
        if self.rps_max < self.rps_min:
            raise ValueError(f"rps_max: {self.rps_max} is below rps_min {self.rps_min}")
        return self

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def device_ids(self) -> list[str]:
        return [d for st in self.stages for d in st.device_ids]

    def layer_ranges(self) -> list[tuple[int, int]]:
        """``[(layer_start, layer_end), ...]`` per stage (end exclusive)."""
        return [(st.layer_start, st.layer_end) for st in self.stages]

    def with_kv_pool_capped(self, max_tokens: int) -> Gear:
        """A copy whose KV pool (gear and every stage) holds at most ``max_tokens`` tokens.

        The planner sizes a stage's pool to all memory left after weights and the reserve; a host
        whose "devices" share its RAM (CPU workers), or a short job, needs far less pre-allocated.
        """
        cap = min(self.kv_capacity_tokens or max_tokens, max_tokens)
        return self.model_copy(update={
            "kv_capacity_tokens": cap,
            "stages": [st.model_copy(update={"kv_capacity_tokens": min(st.kv_capacity_tokens or cap, cap)})
                       for st in self.stages]})
