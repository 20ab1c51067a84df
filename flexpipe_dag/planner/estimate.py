"""Analytic performance estimate of a pipeline plan: throughput, TTFT and TPOT at an operating point.

For a plan with micro-batch ``b``, ``m`` micro-batches in flight (:func:`inflight_micro_batches`:
``max(ceil(N / b), sum_s r_s)``), per-stage decode step
``d_s`` (ms, per replica), prefill ``p_s`` and ``r_s`` replicas:

* decode round trip ``R = sum_s d_s + sum_links (latency + b * act_bytes / bandwidth)``;
* decode spacing at the bottleneck ``D = max_s d_s / r_s``; with ``a`` active micro-batches a token
  is produced every ``TPOT(a) = max(R, a * D)`` per sequence;
* capacity ``X_busy = 1 / max(busy)`` requests per ms (see :mod:`~flexpipe_dag.planner.search`), and by
  Little's law ``X_slots = m b / (TTFT + O * TPOT(m))``; throughput ``X = min(X_busy, X_slots)``;
* TTFT = prefill through every stage and link, plus the wait at the bottleneck: the M/M/1 waiting-time
  quantile ``w_q = ln(rho / (1 - q)) * s / (1 - rho)`` for ``rho > 1 - q`` (Kleinrock 1975, Vol. 1,
  Sec. 3.2), a conservative stand-in for the queue the simulator measures; ``s`` is the bottleneck busy
  time and ``rho = rps / X``.

P50 figures use the mean prompt, P99 figures the P95 context as the prompt (the KV pool is sized at it).

These figures rank candidate plans quickly; they are not an envelope. The simulator contradicts the
M/M/1 tail near saturation (continuous batching puts whole prompts into decode iterations), so the
operating envelopes users and the controller rely on come from
:func:`flexpipe_dag.planner.envelope.refine_envelopes`, which replays a real trace through each gear.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flexpipe_dag.core.gear_builders import inflight_to_fill
from flexpipe_dag.planner.search import FIRST, LAST, MIDDLE, SINGLE, PipelinePlan, PipelineSearch

#: Operating envelopes end at this utilisation of a gear's capacity.
ENVELOPE_UTILISATION = 0.8


@dataclass(frozen=True)
class PlanEstimate:
    """Estimated behaviour of a plan; times in ms, rates per second."""

    throughput_rps: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    tpot_idle_ms: float
    ttft_idle_ms: float
    bottleneck_stage: int
    rps_at_envelope: float


def inflight_micro_batches(plan: PipelinePlan, concurrency: int) -> int:
    """Micro-batches a gear keeps in flight: ``max(ceil(N / b), sum_s r_s)``.

    ``ceil(N / b)`` slots hold the planned concurrency ``N`` in micro-batches of ``b``; but a pipeline
    whose stages have ``r_s`` replicas has ``sum_s r_s`` servers, and each works on one micro-batch at
    a time, so fewer in flight leaves servers idle (a 1-stage gear on 2 replicas with one micro-batch
    of 64 runs at half its capacity). Extra sequences beyond ``N`` are admitted only while the paged
    KV pool has free blocks (the runtime and simulator check), so the memory plan for ``N`` at the
    P95 context still holds.
    """
    return inflight_to_fill(sum(len(ds) for ds in plan.device_ids), concurrency, plan.micro_batch_size)


def _wait_quantile_ms(rho: float, service_ms: float, q: float) -> float:
    if rho <= 0 or rho <= 1 - q:
        return 0.0
    rho = min(rho, 0.999)
    return math.log(rho / (1 - q)) * service_ms / (1 - rho)


def estimate_plan(search: PipelineSearch, plan: PipelinePlan, utilisation: float = ENVELOPE_UTILISATION,
                  rps: float | None = None) -> PlanEstimate:
    """Estimate ``plan`` at ``rps`` requests/s, or at ``utilisation`` x its throughput when ``rps`` is None.

    Formulas in the module docstring; ``rps`` above the plan's throughput is clipped to it.
    """
    w = search.workload
    cm = search.cm
    micro_batch_size = plan.micro_batch_size
    S = plan.num_stages
    roles = [SINGLE] if S == 1 else [FIRST] + [MIDDLE] * (S - 2) + [LAST]
    dec, pf_mean, pf_p95 = [], [], []
    for ds, k, role in zip(plan.device_ids, plan.sizes, roles):
        first, last = role in (FIRST, SINGLE), role in (LAST, SINGLE)
        t = search.tables(ds[0], micro_batch_size, len(ds))
        dec.append(float(t.decode_ms[role, k]))
        pf_mean.append(float(t.prefill_ms[role, k]))
        pf_p95.append(cm.stage_prefill_ms(ds[0], k, first, last, w.context_p95_tokens))
    hops = list(zip(plan.device_ids, plan.device_ids[1:]))
    tr_dec = sum(cm.transfer_ms(a[0], c[0], micro_batch_size) for a, c in hops)
    tr_pf = sum(cm.transfer_ms(a[0], c[0], w.prompt_tokens_mean) for a, c in hops)
    tr_pf95 = sum(cm.transfer_ms(a[0], c[0], w.context_p95_tokens) for a, c in hops)
    R = sum(dec) + tr_dec
    D = max(d / len(ds) for d, ds in zip(dec, plan.device_ids))
    m = inflight_micro_batches(plan, w.concurrency)
    ttft_idle = sum(pf_mean) + tr_pf
    tpot_full = max(R, m * D)
    x_busy = 1e3 / plan.bottleneck_ms
    x_slots = m * micro_batch_size * 1e3 / (ttft_idle + w.output_tokens_mean * tpot_full)
    x = min(x_busy, x_slots)
    rps = utilisation * x if rps is None else min(rps, x)
    rho = rps / x_busy
    service = plan.bottleneck_ms
    active = max(1.0, min(m, rps * (ttft_idle + w.output_tokens_mean * tpot_full) / 1e3 / micro_batch_size))
    tpot_p50 = max(R, active * D)
    # a decode step that waits behind one prefill chunk on the bottleneck stage
    s_b = max(range(S), key=lambda i: plan.stage_busy_ms[i])
    chunk = w.prefill_chunk_tokens
    k_b = plan.sizes[s_b]
    chunk_ms = cm.stage_prefill_ms(plan.device_ids[s_b][0], k_b, roles[s_b] in (FIRST, SINGLE),
                                   roles[s_b] in (LAST, SINGLE), min(chunk, w.context_p95_tokens))
    tpot_p99 = max(R, m * D) + chunk_ms
    ttft_p50 = ttft_idle + _wait_quantile_ms(rho, service, 0.5)
    ttft_p99 = sum(pf_p95) + tr_pf95 + _wait_quantile_ms(rho, service, 0.99)
    bottleneck = max(range(S), key=lambda i: plan.stage_busy_ms[i])
    return PlanEstimate(
        throughput_rps=x, tokens_per_s=x * w.output_tokens_mean, ttft_p50_ms=ttft_p50, ttft_p99_ms=ttft_p99,
        tpot_p50_ms=tpot_p50, tpot_p99_ms=tpot_p99, tpot_idle_ms=R, ttft_idle_ms=ttft_idle,
        bottleneck_stage=bottleneck, rps_at_envelope=rps)
