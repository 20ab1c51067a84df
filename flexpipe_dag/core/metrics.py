"""Metric samples: the one schema both the simulator and the live runtime emit (every 2 s).

The controller reads these and nothing else, so it behaves the same on simulated and live data.
Times are in ms, rates per second, ``t_s`` in seconds since the start of the run (simulated or
wall clock).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: Default sampling period of both emitters, seconds (design seed figure).
SAMPLE_PERIOD_S = 2.0

#: What ``MetricSample.rps`` means, for the simulator, the live runtime and every reader alike.
RPS_DEFINITION = ("online requests that arrived in the window per second (refused ones included); offline batch "
                  "work and shift probes excluded")


@dataclass(frozen=True)
class StageSample:
    """One stage over one sampling window."""

    stage_index: int
    busy_fraction: float  # 0..1, time the stage's devices computed / (window x replicas)
    queue_length: int  # micro-batches waiting at the stage at the end of the window
    kv_blocks_used: int
    kv_blocks_total: int


@dataclass(frozen=True)
class MetricSample:
    """One pipeline-wide sample over the window ``(t_s - period, t_s]``.

    Latency percentiles are over online requests that finished (TTFT: got their first token) in the
    window; ``None`` when none did. Offline (batch) work sharing the pipeline is left out of them and of
    ``completed``, as it is of ``rps``: the controller watches the online service, and a batch job's
    queueing time is not an online latency. ``queue_length`` and ``running`` count every request.
    """

    t_s: float
    gear_id: str
    source: str  # "sim" or "live"
    rps: float  # online arrivals per second in the window (RPS_DEFINITION)
    completed: int  # online requests finished in the window
    tokens_per_s: float  # output tokens per second in the window
    queue_length: int  # requests waiting for admission at t_s
    running: int  # requests admitted and unfinished at t_s
    kv_used_fraction: float
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    e2e_p99_ms: float | None = None
    stages: tuple[StageSample, ...] = field(default_factory=tuple)

    @property
    def records_work(self) -> bool:
        """Whether the window saw any traffic: arrivals, completions or output tokens, or requests running or
        queued at its end (an idle pipeline's empty windows do not)."""
        return bool(self.rps or self.completed or self.tokens_per_s or self.running or self.queue_length)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MetricSample:
        data = dict(data)
        data["stages"] = tuple(StageSample(**s) for s in data.get("stages", ()))
        return cls(**data)
