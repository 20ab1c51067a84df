"""Simulation results: per-request outcomes, metric samples, gear shifts, and the summary users see."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from flexpipe_dag.core.metrics import MetricSample
from flexpipe_dag.sim.config import SimConfig
from flexpipe_dag.workload.context import CONTEXT_REASON, ContextReport
from flexpipe_dag.workload.request import Workload

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class ShiftEvent:
    """A gear shift in the simulation: requested at ``requested_s``, admitting on the new gear from
    ``switched_s``, the old gear empty at ``drained_s`` (``None`` while still draining)."""

    requested_s: float
    switched_s: float
    from_gear_id: str
    to_gear_id: str
    drained_s: float | None


@dataclass(frozen=True)
class RunRecord:
    """What the simulator hands over to build a :class:`SimResult` (its internal state stays its own).

    Per-request lists follow ``workload.requests``' order; times are simulated seconds, ``-1`` where
    not reached (first token, finish).

    Attributes:
        workload: the simulated requests.
        config: the simulator settings (SLOs among them).
        arrival_s / first_token_s / finish_s: per request.
        preemptions / rejected / gear_ids: per request: times preempted, refused, the gear that served it.
        stage_busy_s: per gear, busy seconds of each stage (replicas averaged).
        samples: the metric samples emitted.
        shifts: the gear shifts.
        first_gear_id / final_gear_id: the gear at the start and the one admitting at the end.
        reject_reasons: per request, why it was rejected (``"context"``, ``"kv_capacity"``) or ``""``.
        context_truncated: per request, whether its prompt was cut to the model's max context.
        context: what the context rule did (``None``: not applied).
    """

    workload: Workload
    config: SimConfig
    arrival_s: Sequence[float]
    first_token_s: Sequence[float]
    finish_s: Sequence[float]
    preemptions: Sequence[int]
    rejected: Sequence[bool]
    gear_ids: Sequence[str]
    stage_busy_s: dict[str, list[float]]
    samples: Sequence[MetricSample]
    shifts: list[ShiftEvent]
    first_gear_id: str
    final_gear_id: str
    reject_reasons: Sequence[str] = ()
    context_truncated: Sequence[bool] = ()
    context: ContextReport | None = None


@dataclass
class SimResult:
    """What a simulation produced.

    Attributes:
        requests: one row per request: ``request_id, class, priority, arrival_s, first_token_s,
            finish_s, input_tokens, output_tokens, preemptions, rejected, reject_reason,
            context_truncated, gear_id, ttft_ms, tpot_ms, e2e_ms, slo_met`` (times NaN where not
            reached; ``tpot_ms`` NaN for one-token outputs; ``reject_reason`` ``"context"`` (over the
            model's max context) / ``"kv_capacity"`` (larger than the KV pool) / ``""``; token counts
            as simulated, i.e. after truncation).
        samples: the metric samples, one per ``sample_period_s``.
        shifts: gear shifts with their switch and drain times.
        summary: see :func:`summarize`.
    """

    requests: pd.DataFrame
    samples: list[MetricSample]
    shifts: list[ShiftEvent]
    summary: dict[str, Any] = field(default_factory=dict)

    def timeseries(self) -> pd.DataFrame:
        """Samples as a frame: ``t_s, rps, completed, tokens_per_s, queue_length, running,
        kv_used_fraction, ttft_p99_ms, ..., stage<i>_busy`` (queue length and KV use over time)."""
        rows = []
        for s in self.samples:
            d = s.to_dict()
            stages = d.pop("stages")
            for st in stages:
                d[f"stage{st['stage_index']}_busy"] = st["busy_fraction"]
                d[f"stage{st['stage_index']}_queue"] = st["queue_length"]
            rows.append(d)
        return pd.DataFrame(rows)


def _dist(values: np.ndarray) -> dict[str, float | None]:
    v = values[~np.isnan(values)]
    if v.size == 0:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    pct = np.percentile(v, PERCENTILES)
    return {"mean": float(v.mean()), **{f"p{q}": float(x) for q, x in zip(PERCENTILES, pct)}}


def _class_summary(df: pd.DataFrame, makespan_s: float) -> dict[str, Any]:
    done = df[df["finish_s"].notna()]
    return {
        "requests": int(len(df)),
        "completed": int(len(done)),
        "ttft_ms": _dist(done["ttft_ms"].to_numpy()),
        "tpot_ms": _dist(done["tpot_ms"].to_numpy()),
        "e2e_ms": _dist(done["e2e_ms"].to_numpy()),
        "throughput_rps": len(done) / makespan_s if makespan_s > 0 else 0.0,
        "goodput_rps": float(done["slo_met"].sum()) / makespan_s if makespan_s > 0 else 0.0,
        "slo_attainment": float(done["slo_met"].sum()) / len(df) if len(df) else 0.0,
    }


#: Share of a replay's first arrivals an envelope probe does not grade (its queues are still filling).
ENVELOPE_WARMUP_FRACTION = 0.25


def attainment_after_warmup(frame: pd.DataFrame, warmup_fraction: float = ENVELOPE_WARMUP_FRACTION) -> float:
    """Share of the requests after the first ``warmup_fraction`` of ``frame``'s rows (arrival order) that met
    the SLO (``slo_met``; a rejected or unfinished request did not): how an envelope probe grades a replay
    (:mod:`flexpipe_dag.planner.envelope`). Every row counts when the warm-up would leave none; 0.0 for no rows.
    """
    skip = int(len(frame) * warmup_fraction)
    graded = frame.iloc[skip if skip < len(frame) else 0:]
    return float(graded["slo_met"].mean()) if len(graded) else 0.0


def summarize(frame: pd.DataFrame, samples: list[MetricSample], stage_busy: dict[str, list[float]],
              slo_ttft_ms: float, slo_tpot_ms: float, shifts: int) -> dict[str, Any]:
    """The summary: TTFT / TPOT / end-to-end (mean, P50, P95, P99, ms), throughput (req/s, output
    tokens/s), SLO goodput (requests meeting both SLOs per second) and attainment, per-stage
    utilisation per gear, queue length and KV use over time (mean / P95 / max of the samples),
    per-class breakdown, preemptions, rejected and unfinished ("lost") counts; of the rejected,
    ``rejected_context`` were over the model's max context; ``truncated_context`` were served with
    their prompt cut to it (0 when the frame has no such columns).

    ``makespan_s`` = last finish - first arrival; rates are over it.
    """
    done = frame[frame["finish_s"].notna()]
    if len(frame):
        end = float(np.nanmax(frame["finish_s"].to_numpy())) if len(done) else float(frame["arrival_s"].max())
        makespan = max(end - float(frame["arrival_s"].min()), 0.0)
    else:
        makespan = 0.0
    out_tokens = float(done["output_tokens"].sum())
    q = np.array([s.queue_length for s in samples], dtype=float)
    kv = np.array([s.kv_used_fraction for s in samples], dtype=float)

    def series(v: np.ndarray) -> dict[str, float]:
        if v.size == 0:
            return {"mean": 0.0, "p95": 0.0, "max": 0.0}
        return {"mean": float(v.mean()), "p95": float(np.percentile(v, 95)), "max": float(v.max())}

    summary = {
        "requests": int(len(frame)),
        "completed": int(len(done)),
        "rejected": int(frame["rejected"].sum()),
        "rejected_context": int((frame["reject_reason"] == CONTEXT_REASON).sum()) if "reject_reason" in frame else 0,
        "truncated_context": int(frame["context_truncated"].sum()) if "context_truncated" in frame else 0,
        "unfinished": int(len(frame) - len(done) - frame["rejected"].sum()),
        "preemptions": int(frame["preemptions"].sum()),
        "makespan_s": makespan,
        "ttft_ms": _dist(done["ttft_ms"].to_numpy()),
        "tpot_ms": _dist(done["tpot_ms"].to_numpy()),
        "e2e_ms": _dist(done["e2e_ms"].to_numpy()),
        "throughput_rps": len(done) / makespan if makespan > 0 else 0.0,
        "tokens_per_s": out_tokens / makespan if makespan > 0 else 0.0,
        "goodput_rps": float(done["slo_met"].sum()) / makespan if makespan > 0 else 0.0,
        "slo_attainment": float(done["slo_met"].sum()) / len(frame) if len(frame) else 0.0,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "stage_utilisation": {g: [b / makespan if makespan > 0 else 0.0 for b in busy] for g, busy in stage_busy.items()},
        "queue_length": series(q),
        "kv_used_fraction": series(kv),
        "shifts": shifts,
        "by_class": {k: _class_summary(frame[frame["class"] == k], makespan) for k in ("online", "offline") if (frame["class"] == k).any()},
    }
    return summary


def build_result(run: RunRecord) -> SimResult:
    """Collect a :class:`SimResult` from what a simulator recorded (called by ``Simulator.result``)."""
    reqs = run.workload.requests
    nan = float("nan")
    first = np.array([t if t >= 0 else nan for t in run.first_token_s], dtype=float)
    finish = np.array([t if t >= 0 else nan for t in run.finish_s], dtype=float)
    arrival = np.array(run.arrival_s, dtype=float)
    out = np.array([r.output_tokens for r in reqs], dtype=np.int64)
    ttft_ms = (first - arrival) * 1000.0
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot_ms = np.where(out > 1, (finish - first) * 1000.0 / np.maximum(out - 1, 1), nan)
    e2e_ms = (finish - arrival) * 1000.0
    cfg = run.config
    slo_met = (~np.isnan(finish)) & (ttft_ms <= cfg.slo_ttft_ms) & (np.isnan(tpot_ms) | (tpot_ms <= cfg.slo_tpot_ms))
    frame = pd.DataFrame({
        "request_id": [r.request_id for r in reqs],
        "class": [r.klass for r in reqs],
        "priority": [r.priority for r in reqs],
        "arrival_s": arrival,
        "first_token_s": first,
        "finish_s": finish,
        "input_tokens": [r.input_tokens for r in reqs],
        "output_tokens": out,
        "preemptions": list(run.preemptions),
        "rejected": list(run.rejected),
        "reject_reason": list(run.reject_reasons) if run.reject_reasons else [""] * len(reqs),
        "context_truncated": list(run.context_truncated) if run.context_truncated else [False] * len(reqs),
        "gear_id": list(run.gear_ids),
        "ttft_ms": ttft_ms,
        "tpot_ms": tpot_ms,
        "e2e_ms": e2e_ms,
        "slo_met": slo_met,
    })
    summary = summarize(frame, list(run.samples), run.stage_busy_s, cfg.slo_ttft_ms, cfg.slo_tpot_ms, len(run.shifts))
    summary["gear_id"] = run.first_gear_id
    summary["final_gear_id"] = run.final_gear_id
    summary["context"] = run.context.to_dict() if run.context is not None else None
    return SimResult(requests=frame, samples=list(run.samples), shifts=run.shifts, summary=summary)
