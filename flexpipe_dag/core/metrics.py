"""Metric samples: the one schema both the simulator and the live runtime emit (every 2 s).

The controller reads these and nothing else, so it behaves the same on simulated and live data.
Times are in ms, rates per second, ``t_s`` in seconds since the start of the run (simulated or
wall clock).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
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
    #: Pipeline instances of ``gear_id`` whose windows this sample sums (:func:`merge_instance_samples`): its
    #: rates and counts are the fleet's, so a reader compares them with ``instances`` x the gear's envelope.
    instances: int = 1

    @property
    def records_work(self) -> bool:
        """Whether the window saw any traffic: arrivals, completions or output tokens, or requests running or
        queued at its end (an idle pipeline's empty windows do not)."""
        return bool(self.rps or self.completed or self.tokens_per_s or self.running or self.queue_length)

    def per_instance(self) -> MetricSample:
        """The load one of :attr:`instances` carries: rates and counts divided by ``instances`` (``self`` when
        there is one). Latencies, the KV fraction and stage figures are the merged sample's already."""
        n = self.instances
        if n <= 1:
            return self
        return replace(self, rps=self.rps / n, completed=round(self.completed / n), tokens_per_s=self.tokens_per_s / n,
                       queue_length=round(self.queue_length / n), running=round(self.running / n), instances=1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MetricSample:
        data = dict(data)
        data["stages"] = tuple(StageSample(**s) for s in data.get("stages", ()))
        return cls(**data)


def _weighted_mean(values: Sequence[tuple[float | None, int]]) -> float | None:
    """Mean of the known values weighted by their counts (each weight at least 1); None when none is known."""
    known = [(v, max(w, 1)) for v, w in values if v is not None]
    if not known:
        return None
    return sum(v * w for v, w in known) / sum(w for _, w in known)


def _worst(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def merge_instance_samples(samples: Sequence[MetricSample]) -> MetricSample:
    """One fleet-wide sample from one window of each pipeline instance of the same gear.

    Several instances behind one router each sample their own window; a reader of the serving stream (the
    gear-shift controller, the tide rule, the store's series) needs the load the fleet carries, not one
    instance's share of it in turn. Summed: ``rps``, ``completed``, ``tokens_per_s``, ``queue_length``,
    ``running``, ``instances``, and per stage index ``queue_length``, ``kv_blocks_used``,
    ``kv_blocks_total``. Averaged: ``kv_used_fraction`` and a stage's ``busy_fraction`` (over the instances).
    Latency percentiles cannot be merged exactly without the requests: a p50 is the mean of the instances'
    weighted by their ``completed`` count, a p99 the worst instance's (an upper bound, so an SLO trigger
    never reads better than the worst instance serves). ``t_s`` is the newest window's end.

    Args:
        samples: at least one sample, one per instance, all naming the same gear.

    Returns:
        The merged sample (``samples[0]`` itself when there is one).

    Raises:
        ValueError: no sample, or samples of different gears.
    """
    if not samples:
        raise ValueError("merge_instance_samples: no sample to merge")
    gears = {smp.gear_id for smp in samples}
    if len(gears) > 1:
        raise ValueError(f"merge_instance_samples: samples of different gears {sorted(gears)}; merge one gear's")
    if len(samples) == 1:
        return samples[0]
    by_stage: dict[int, list[StageSample]] = {}
    for smp in samples:
        for st in smp.stages:
            by_stage.setdefault(st.stage_index, []).append(st)
    stages = tuple(StageSample(stage_index=i, busy_fraction=sum(st.busy_fraction for st in group) / len(group),
                               queue_length=sum(st.queue_length for st in group),
                               kv_blocks_used=sum(st.kv_blocks_used for st in group),
                               kv_blocks_total=sum(st.kv_blocks_total for st in group))
                   for i, group in sorted(by_stage.items()))
    latencies: dict[str, float | None] = {}
    for metric in ("ttft", "tpot", "e2e"):
        latencies[f"{metric}_p50_ms"] = _weighted_mean([(getattr(smp, f"{metric}_p50_ms"), smp.completed)
                                                        for smp in samples])
        latencies[f"{metric}_p99_ms"] = _worst([getattr(smp, f"{metric}_p99_ms") for smp in samples])
    return MetricSample(
        t_s=max(smp.t_s for smp in samples), gear_id=samples[0].gear_id, source=samples[0].source,
        rps=sum(smp.rps for smp in samples), completed=sum(smp.completed for smp in samples),
        tokens_per_s=sum(smp.tokens_per_s for smp in samples),
        queue_length=sum(smp.queue_length for smp in samples), running=sum(smp.running for smp in samples),
        kv_used_fraction=sum(smp.kv_used_fraction for smp in samples) / len(samples),
        stages=stages, instances=sum(smp.instances for smp in samples), **latencies)
