"""Simulator settings: sampling period, SLOs, the model's context rule, and optional overrides of a gear's
batching / KV limits."""

from __future__ import annotations

from dataclasses import dataclass

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.metrics import SAMPLE_PERIOD_S
from flexpipe_dag.workload.context import ContextPolicy, check_context_policy, check_max_context_tokens


@dataclass(frozen=True)
class SimConfig:
    """How to simulate.

    Attributes:
        sample_period_s: metric sample period (design seed: 2 s).
        slo_ttft_ms / slo_tpot_ms: a request meets its SLO when TTFT <= slo_ttft_ms and TPOT <=
            slo_tpot_ms (TPOT is not checked for one-token outputs). Defaults 2 s / 200 ms are in the
            range serving papers use for chat (e.g. DistServe, OSDI'24, Table 1).
        micro_batch_size: sequences per micro-batch (default: ``gear.micro_batch_size``).
        max_inflight_micro_batches: default ``gear.max_inflight_micro_batches``.
        kv_capacity_tokens: KV pool size (default: ``gear.kv_capacity_tokens``, else the minimum of
            the stages' ``kv_capacity_tokens``; 0 / unknown everywhere means an unbounded pool).
        prefill_token_budget: most prompt tokens admitted into one micro-batch iteration (one
            prompt is always allowed); ``None`` = no limit beyond ``micro_batch_size``. With
            ``chunked_prefill``: the token budget of one iteration, one per decode plus prompt chunks.
        chunked_prefill: prompts are cut into chunks that fill what ``prefill_token_budget`` leaves
            after the decodes, oldest prompt first, and a prompt's first token comes out of its last
            chunk: the runtime scheduler's ``chunked_prefill`` (Sarathi-Serve, OSDI'24). A budget below
            the micro-batch size caps the sequences per micro-batch. A chunk is timed as a prefill of
            its own tokens (the context before it is not charged).
        decode_context_quantum_tokens: decode times are memoised on a grid of this many context
            tokens and linearly interpolated (exact for costs linear in context; 0 = no memo).
        preempt_offline_for_online: an online request that cannot get KV blocks may preempt
            offline sequences of the micro-batch being scheduled (recompute later).
        max_context_tokens: the model's maximum context (prompt + output tokens;
            ``ModelSpec.max_context_tokens``); ``None`` = not known, nothing checked.
        context_policy: what happens to a request over ``max_context_tokens``
            (:mod:`flexpipe_dag.workload.context`): ``"refuse"`` (rejected at arrival, reason
            ``"context"``) or ``"truncate"`` (served with its prompt cut from the left).
        metric_samples: emit a :class:`~flexpipe_dag.core.metrics.MetricSample` every
            ``sample_period_s``. ``False`` (envelope probes, which grade per-request outcomes only)
            skips the per-window bookkeeping: no samples, and the summary's queue-length and KV-use
            series read 0. Per-request results and stage utilisation are the same either way.
    """

    sample_period_s: float = SAMPLE_PERIOD_S
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0
    micro_batch_size: int | None = None
    max_inflight_micro_batches: int | None = None
    kv_capacity_tokens: int | None = None
    prefill_token_budget: int | None = None
    chunked_prefill: bool = False
    preempt_offline_for_online: bool = True
    decode_context_quantum_tokens: int = 64
    max_context_tokens: int | None = None
    context_policy: ContextPolicy = "refuse"
    metric_samples: bool = True

    def __post_init__(self) -> None:
        checks = {
            "sample_period_s": self.sample_period_s > 0,
            "slo_ttft_ms": self.slo_ttft_ms > 0,
            "slo_tpot_ms": self.slo_tpot_ms > 0,
            "micro_batch_size": self.micro_batch_size is None or self.micro_batch_size >= 1,
            "max_inflight_micro_batches": self.max_inflight_micro_batches is None or self.max_inflight_micro_batches >= 1,
            "kv_capacity_tokens": self.kv_capacity_tokens is None or self.kv_capacity_tokens >= 0,
            "prefill_token_budget": self.prefill_token_budget is None or self.prefill_token_budget >= 1,
            "decode_context_quantum_tokens": self.decode_context_quantum_tokens >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise InputError("SimConfig", name, f"got {getattr(self, name)!r}; expected a positive value")
        if self.chunked_prefill and self.prefill_token_budget is None:
            raise InputError("SimConfig", "prefill_token_budget", "expected a token budget with chunked_prefill, got None")
        check_max_context_tokens(self.max_context_tokens, "SimConfig")
        check_context_policy(self.context_policy, "SimConfig")
