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
                            min_residence_s=min_residence_s)
    return workload, rule.report
