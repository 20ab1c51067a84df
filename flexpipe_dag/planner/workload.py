"""The workload a gear is planned for: concurrency, context lengths, memory reserve, link headroom."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flexpipe_dag.core.cluster import BF16_FALLBACKS, Bf16Fallback
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.workload.context import ContextPolicy, ContextReport, apply_context_rule
from flexpipe_dag.workload.request import Workload


@dataclass(frozen=True)
class PlanWorkload:
    """Planning assumptions (units in the names).

    Attributes:
        context_p95_tokens: P95 of prompt + generated tokens per sequence; the KV pool is sized at it.
        concurrency: sequences in flight the KV pool must hold at ``context_p95_tokens`` each.
        prompt_tokens_mean: mean prompt length (prefill work per request).
        output_tokens_mean: mean generated tokens per request (decode steps per request).
        prefill_chunk_tokens: chunked-prefill size; sizes the activation workspace.
        reserve_fraction: device memory kept free (the design asks for 10-15 %).
        link_utilisation_max: adjacent-stage traffic may use at most this share of a link (0.7).
        min_residence_s: a device whose ``available_until`` is sooner than this is not used.
        micro_batch_size_candidates: micro-batch sizes (sequences per micro-batch) the search may try;
            :meth:`micro_batch_sizes_to_search` caps them at ``concurrency``.
        slo_ttft_ms / slo_tpot_ms: the SLO the analytic envelope is computed at (a request meets it
            when TTFT <= slo_ttft_ms and mean TPOT <= slo_tpot_ms); defaults as the simulator's.
        slo_attainment: share of requests that must meet the SLO at the envelope (as
            :func:`~flexpipe_dag.planner.envelope.measure_envelope`).
        prompt_tokens_cv: coefficient of variation of prompt lengths (1.0: exponential-like; the
            Azure conversation / code traces have 0.9-1.0). Sets the variance of prefill work.
        arrival_scv: squared coefficient of variation of inter-arrival times (1.0 = Poisson; real
            traces are burstier). Enters the admission queue by Kingman's formula.
        bf16_fallback: a bf16 gear on devices without bf16 (V100, T4): ``"fp16"`` runs the whole gear
            in fp16, ``"exclude"`` leaves those devices out, ``"refuse"`` raises; see
            :func:`flexpipe_dag.core.cluster.choose_gear_dtype`.
    """

    context_p95_tokens: int = 4096
    concurrency: int = 64
    prompt_tokens_mean: int = 1024
    output_tokens_mean: int = 256
    prefill_chunk_tokens: int = 512
    reserve_fraction: float = 0.12
    link_utilisation_max: float = 0.7
    min_residence_s: float = 600.0
    micro_batch_size_candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0
    slo_attainment: float = 0.95
    prompt_tokens_cv: float = 1.0
    arrival_scv: float = 1.0
    bf16_fallback: Bf16Fallback = "fp16"

    def __post_init__(self) -> None:
        for name in ("context_p95_tokens", "concurrency", "prompt_tokens_mean", "output_tokens_mean",
                     "prefill_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InputError("workload", name, f"expected a positive integer, got {value!r}")
        if not 0.10 <= self.reserve_fraction <= 0.15:
            raise InputError("workload", "reserve_fraction", f"expected 0.10..0.15 (10-15 %), got {self.reserve_fraction}")
        if not 0 < self.link_utilisation_max <= 1:
            raise InputError("workload", "link_utilisation_max", f"expected (0, 1], got {self.link_utilisation_max}")
        if self.min_residence_s < 0:
            raise InputError("workload", "min_residence_s", f"expected >= 0, got {self.min_residence_s}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise InputError("workload", name, f"expected a positive number of ms, got {value!r}")
        if not 0.5 <= self.slo_attainment < 1:
            raise InputError("workload", "slo_attainment", f"expected 0.5 <= share < 1, got {self.slo_attainment}")
        for name in ("prompt_tokens_cv", "arrival_scv"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value <= 100:
                raise InputError("workload", name, f"expected 0..100, got {value!r}")
        if self.bf16_fallback not in BF16_FALLBACKS:
            raise InputError("workload", "bf16_fallback", f"expected one of {', '.join(BF16_FALLBACKS)}, "
                                                          f"got {self.bf16_fallback!r}")
        if not self.micro_batch_size_candidates or any(size < 1 for size in self.micro_batch_size_candidates):
            raise InputError("workload", "micro_batch_size_candidates",
                             f"expected positive sizes, got {self.micro_batch_size_candidates}")

    @property
    def decode_context_mean_tokens(self) -> float:
        """Mean KV context of a sequence during decode: prompt + half the output."""
        return self.prompt_tokens_mean + self.output_tokens_mean / 2.0

    def micro_batch_sizes_to_search(self) -> list[int]:
        """Micro-batch sizes the search tries: the candidates capped at the concurrency, ascending, unique."""
        return sorted({min(size, self.concurrency) for size in self.micro_batch_size_candidates})


def plan_workload_from_trace(trace: Workload, *, max_context_tokens: int | None, context_policy: ContextPolicy = "refuse",
                             context_p95_cap_tokens: int | None = None, concurrency: int = 64,
                             min_residence_s: float = 600.0) -> tuple[PlanWorkload, ContextReport]:
    """Planning assumptions from a request trace, under the context rule the simulator and runtime apply.

    Requests whose prompt + output exceed ``max_context_tokens`` (the model's max context) are left
    out (``"refuse"``) or truncated (``"truncate"``; :mod:`flexpipe_dag.workload.context`) before
    the statistics are taken: ``prompt_tokens_mean`` / ``output_tokens_mean`` (tokens per request)
    and ``context_p95_tokens`` (P95 of prompt + output tokens, at most ``context_p95_cap_tokens``).

    Returns:
        ``(workload, report)``: the :class:`PlanWorkload` and how many requests were over the context.

    Raises:
        InputError: the trace is empty, or no request fits the max context.
    """
    rule = apply_context_rule(trace, max_context_tokens, context_policy)
    reqs = rule.workload.requests
    if not reqs:
        why = (f"all {len(trace)} requests exceed the max context of {max_context_tokens} tokens; expected some "
               "that fit (or truncate them)" if len(trace) else "expected at least one request")
        raise InputError(trace.source or trace.name, None, why)
    prompt = np.array([r.input_tokens for r in reqs], dtype=np.int64)
    output = np.array([r.output_tokens for r in reqs], dtype=np.int64)
    p95 = max(1, int(np.percentile(prompt + output, 95)))
    if context_p95_cap_tokens is not None:
        p95 = min(context_p95_cap_tokens, p95)
    workload = PlanWorkload(context_p95_tokens=p95, concurrency=concurrency,
                            prompt_tokens_mean=max(1, int(prompt.mean())), output_tokens_mean=max(1, int(output.mean())),
                            min_residence_s=min_residence_s,
                            prompt_tokens_cv=min(100.0, float(prompt.std() / max(prompt.mean(), 1e-9))),
                            arrival_scv=arrival_burstiness([r.arrival_s for r in reqs]))
    return workload, rule.report


def arrival_burstiness(arrival_s: list[float], arrivals_per_window: int = 16) -> float:
    """Index of dispersion of arrival counts (variance / mean) in windows of about ``arrivals_per_window``
    mean arrivals: 1 for Poisson, larger for bursty traffic; used as Kingman's ``c_a^2`` (Whitt 1982,
    renewal approximation of a point process). Capped at 100; 1.0 for fewer than 2 arrivals.
    """
    a = np.sort(np.asarray(arrival_s, dtype=float))
    if len(a) < 2 or a[-1] <= a[0]:
        return 1.0
    win = arrivals_per_window * (a[-1] - a[0]) / (len(a) - 1)
    counts = np.histogram(a, bins=np.arange(a[0], a[-1] + win, win))[0]
    return float(min(100.0, counts.var() / counts.mean())) if counts.mean() > 0 else 1.0
