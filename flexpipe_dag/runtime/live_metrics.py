"""Live metric windows (pure): turn runtime events and stage counters into MetricSample objects.

Every ``period_s`` (2 s by default, :data:`flexpipe_dag.core.metrics.SAMPLE_PERIOD_S`) the driver
calls :meth:`LiveMetrics.sample` with the scheduler's queue state and each stage's cumulative
counters; the sample covers ``(t_s - period, t_s]``, the same schema the simulator emits
(``source="live"``). Stage busy fraction = busy seconds in the window / window length; stage queue
length = micro-batches that reached the stage (done by the previous stage, or sent by the driver
for stage 0) minus those it finished.

``rps`` is the online request rate, one definition for every reader (the controller, the
``tide_sensor``, the serve loop's offline admission, the simulator's samples): online requests that
arrived in the window per second, refused ones included; offline (batch) work and the shift
executor's verification probes are not counted, so admitting offline work in a trough does not
read as a rise in the load (:data:`flexpipe_dag.core.metrics.RPS_DEFINITION`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flexpipe_dag.core.metrics import MetricSample, StageSample
from flexpipe_dag.runtime.scheduler import PRIORITY_ONLINE


@dataclass(frozen=True)
class StageCounters:
    """Cumulative counters of one stage since start: micro-batches done and busy seconds."""

    steps_done: int
    busy_s: float


def _pcts(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    arr = np.asarray(values) * 1000.0
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


class LiveMetrics:
    """Accumulates one window of events; :meth:`sample` closes the window.

    Args:
        gear_id: written into every sample.
        start_s: clock reading (s) taken as ``t_s = 0``.
    """

    def __init__(self, gear_id: str, start_s: float):
        self.gear_id = gear_id
        self.start_s = start_s
        self._last_t_s = 0.0
        self._arrivals = 0
        self._tokens = 0
        self._ttft: list[float] = []
        self._tpot: list[float] = []
        self._e2e: list[float] = []
        self._prev: list[StageCounters] | None = None

    def record_arrivals(self, n: int, priority: int = PRIORITY_ONLINE) -> None:
        """``n`` requests of ``priority`` arrived; only online ones (``PRIORITY_ONLINE``) count toward ``rps``."""
        if priority == PRIORITY_ONLINE:
            self._arrivals += n

    def record_tokens(self, n: int) -> None:
        """Output tokens produced (every sampled token, finished request or not)."""
        self._tokens += n

    def record_finished(self, ttft_s: float, tpot_s: float | None, e2e_s: float,
                        priority: int = PRIORITY_ONLINE) -> None:
        """A request finished (times in s); only online ones (``PRIORITY_ONLINE``) count toward ``completed`` and
        the latency percentiles (an offline job's wait in the queue is not an online latency)."""
        if priority != PRIORITY_ONLINE:
            return
        self._ttft.append(ttft_s)
        if tpot_s is not None:
            self._tpot.append(tpot_s)
        self._e2e.append(e2e_s)

    def sample(self, now_s: float, *, queue_length: int, running: int, kv_blocks_used: int, kv_blocks_total: int,
               micro_batches_sent: int, stages: list[StageCounters]) -> MetricSample:
        """Close the window ending at clock ``now_s`` and return its sample."""
        t_s = now_s - self.start_s
        window = max(t_s - self._last_t_s, 1e-9)
        prev = self._prev or [StageCounters(0, 0.0)] * len(stages)
        stage_samples = []
        for i, (cur, old) in enumerate(zip(stages, prev)):
            arrived = micro_batches_sent if i == 0 else stages[i - 1].steps_done
            stage_samples.append(StageSample(
                stage_index=i,
                busy_fraction=min(1.0, max(0.0, (cur.busy_s - old.busy_s) / window)),
                queue_length=max(0, arrived - cur.steps_done),
                kv_blocks_used=kv_blocks_used,
                kv_blocks_total=kv_blocks_total,
            ))
        ttft50, ttft99 = _pcts(self._ttft)
        tpot50, tpot99 = _pcts(self._tpot)
        e2e50, e2e99 = _pcts(self._e2e)
        s = MetricSample(
            t_s=t_s, gear_id=self.gear_id, source="live", rps=self._arrivals / window, completed=len(self._e2e),
            tokens_per_s=self._tokens / window, queue_length=queue_length, running=running,
            kv_used_fraction=kv_blocks_used / kv_blocks_total if kv_blocks_total else 0.0,
            ttft_p50_ms=ttft50, ttft_p99_ms=ttft99, tpot_p50_ms=tpot50, tpot_p99_ms=tpot99,
            e2e_p50_ms=e2e50, e2e_p99_ms=e2e99, stages=tuple(stage_samples))
        self._last_t_s = t_s
        self._arrivals = self._tokens = 0
        self._ttft, self._tpot, self._e2e = [], [], []
        self._prev = list(stages)
        return s
