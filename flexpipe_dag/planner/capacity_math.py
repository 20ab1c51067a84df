"""The capacity arithmetic a user can check by hand: weights, KV per token, concurrency, KV need, cards by memory.

Steps (units in the names; ``GiB`` = 2^30 bytes):

1. **weights**: :meth:`ModelSpec.weight_bytes` (parameters x bytes per parameter of the dtype; the
   embedding and LM head in 16-bit even for int8 / int4 weights).
2. **KV per token**: ``2 x layers x kv_heads x head_dim x kv_dtype_bytes``
   (:meth:`ModelSpec.kv_bytes_per_token`; Llama-3-8B in bf16: 2 x 32 x 8 x 128 x 2 = 131072 B = 128 KiB).
3. **concurrency** by Little's law, ``L = lambda W`` (J. D. C. Little, "A proof for the queuing formula
   L = lambda W", Operations Research 9(3), 1961): a request stays in the system at most
   ``W = TTFT + output_p95 x TPOT`` when it meets the SLO (the P95 output, each token at the TPOT
   target), so at ``load_rps`` the sequences in flight are ``C = ceil(load_rps x W)``; the SLO
   targets make it an upper bound for the requests that meet them.
4. **KV need**: ``C x context_p95 x KV per token`` (every sequence in flight at the P95 context).
5. **memory per card**: ``(visible GiB - CUDA context 0.5 GiB) x (1 - reserve)``
   (:meth:`Device.usable_memory_gib`, the planner's own rule; the design keeps 10-15 % in reserve).
6. **cards by memory**: ``ceil((weights + KV need) / memory per card)`` for one pipeline holding
   everything, and ``ceil((weights + context_p95 x KV per token) / memory per card)`` for the
   smallest pipeline that holds the model and one P95 sequence. Compute (the SLO envelope) is
   checked separately, by planning gears (:mod:`flexpipe_dag.planner.capacity`).

Pure: plain numbers in and out.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.planner.model_spec import GIB, ModelSpec

#: The design's memory reserve range ("keep 10-15 % of device memory in reserve").
RESERVE_MIN, RESERVE_MAX = 0.10, 0.15
DEFAULT_RESERVE = 0.15
#: Highest load a capacity plan is asked for, req/s: a typo guard (a million req/s is far above any one
#: model's deployment; beyond ~1e290 the arithmetic overflows).
MAX_LOAD_RPS = 1e6


def check_reserve(reserve_fraction: float, source: str | None = None, field: str = "--reserve") -> float:
    """``reserve_fraction`` checked against the design's 10-15 %.

    Raises:
        InputError: not a number in [0.10, 0.15].
    """
    if isinstance(reserve_fraction, bool) or not isinstance(reserve_fraction, (int, float)) \
            or not RESERVE_MIN <= reserve_fraction <= RESERVE_MAX:
        raise InputError(source, field, f"expected {RESERVE_MIN:g}..{RESERVE_MAX:g} (the design's 10-15 % reserve), "
                                        f"got {reserve_fraction!r}")
    return float(reserve_fraction)


def little_concurrency(load_rps: float, slo_ttft_ms: float, slo_tpot_ms: float,
                       output_p95_tokens: int) -> tuple[float, int]:
    """Sequences in flight by Little's law: ``(W_s, ceil(load_rps x W_s))``, ``W_s = (TTFT + O95 x TPOT) / 1000``.

    Args:
        load_rps: arrival rate, req/s. slo_ttft_ms / slo_tpot_ms: the SLO targets, ms.
        output_p95_tokens: P95 of generated tokens per request.

    Returns:
        The residence time of a request at the SLO bound, seconds, and the concurrency (at least 1).
    """
    residence_s = (slo_ttft_ms + output_p95_tokens * slo_tpot_ms) / 1000.0
    return residence_s, max(1, math.ceil(load_rps * residence_s - 1e-9))


@dataclass(frozen=True)
class CapacityNeed:
    """What the load asks for, before any card type is chosen (units in the names)."""

    model_name: str
    dtype: str
    load_rps: float
    slo_ttft_ms: float
    slo_tpot_ms: float
    context_p95_tokens: int
    output_p95_tokens: int
    reserve_fraction: float
    weight_bytes: float
    kv_bytes_per_token: float
    residence_s: float
    concurrency: int
    kv_need_tokens: int
    kv_need_bytes: float

    @property
    def one_sequence_bytes(self) -> float:
        """KV bytes of one sequence at the P95 context."""
        return self.context_p95_tokens * self.kv_bytes_per_token

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures (bytes also as GiB)."""
        out = asdict(self)
        out.update(weight_gib=self.weight_bytes / GIB, kv_kib_per_token=self.kv_bytes_per_token / 1024,
                   kv_need_gib=self.kv_need_bytes / GIB)
        return out


def capacity_need(model: ModelSpec, *, dtype: str, load_rps: float, slo_ttft_ms: float, slo_tpot_ms: float,
                  context_p95_tokens: int, output_p95_tokens: int,
                  reserve_fraction: float = DEFAULT_RESERVE) -> CapacityNeed:
    """Steps 1-4 of the module docstring for ``model`` at ``load_rps`` and the SLO.

    Raises:
        InputError: a figure out of range (load <= 0 or above :data:`MAX_LOAD_RPS`, SLO <= 0, token counts < 1, output P95 above the
            context P95, reserve outside 10-15 %), named.
    """
    check_reserve(reserve_fraction)
    if not (math.isfinite(load_rps) and 0 < load_rps <= MAX_LOAD_RPS):
        raise InputError(None, "--load-rps", f"expected a load > 0 and <= {MAX_LOAD_RPS:g} req/s, got {load_rps!r}")
    for name, value in (("--slo-ttft-ms", slo_ttft_ms), ("--slo-tpot-ms", slo_tpot_ms)):
        if not (math.isfinite(value) and value > 0):
            raise InputError(None, name, f"expected a positive number of ms, got {value!r}")
    for name, tokens in (("--context-p95", context_p95_tokens), ("--output-p95", output_p95_tokens)):
        if tokens < 1:
            raise InputError(None, name, f"expected >= 1 token, got {tokens}")
    if output_p95_tokens > context_p95_tokens:
        raise InputError(None, "--output-p95", f"{output_p95_tokens} tokens exceeds the P95 context of "
                                               f"{context_p95_tokens} (prompt + output); expected <= it")
    kv_token = model.kv_bytes_per_token(dtype)
    residence_s, concurrency = little_concurrency(load_rps, slo_ttft_ms, slo_tpot_ms, output_p95_tokens)
    kv_tokens = concurrency * context_p95_tokens
    return CapacityNeed(model_name=model.name, dtype=dtype, load_rps=load_rps, slo_ttft_ms=slo_ttft_ms,
                        slo_tpot_ms=slo_tpot_ms, context_p95_tokens=context_p95_tokens,
                        output_p95_tokens=output_p95_tokens, reserve_fraction=reserve_fraction,
                        weight_bytes=model.weight_bytes(dtype), kv_bytes_per_token=kv_token,
                        residence_s=residence_s, concurrency=concurrency, kv_need_tokens=kv_tokens,
                        kv_need_bytes=kv_tokens * kv_token)


def cards_by_memory(need: CapacityNeed, usable_bytes_per_card: float) -> tuple[int, int]:
    """Step 6: ``(cards holding the weights + the whole KV need, cards holding the weights + one P95 sequence)``.

    Raises:
        InputError: ``usable_bytes_per_card`` is not > 0.
    """
    if not usable_bytes_per_card > 0:
        raise InputError(None, "usable_bytes_per_card", f"expected > 0, got {usable_bytes_per_card!r}")
    whole = math.ceil((need.weight_bytes + need.kv_need_bytes) / usable_bytes_per_card - 1e-9)
    smallest = math.ceil((need.weight_bytes + need.one_sequence_bytes) / usable_bytes_per_card - 1e-9)
    return max(1, whole), max(1, smallest)


def need_steps(need: CapacityNeed) -> list[str]:
    """The arithmetic of steps 1-4 as lines a user can redo by hand."""
    kib = need.kv_bytes_per_token / 1024
    return [
        f"weights: {need.model_name} in {need.dtype} = {need.weight_bytes / GIB:.2f} GiB",
        f"KV per token: 2 x layers x kv_heads x head_dim x bytes = {need.kv_bytes_per_token:.0f} B = {kib:g} KiB",
        f"residence at the SLO: W = TTFT + output_p95 x TPOT = {need.slo_ttft_ms:g} ms + {need.output_p95_tokens} x "
        f"{need.slo_tpot_ms:g} ms = {need.residence_s:.3f} s",
        f"concurrency (Little's law L = lambda W): ceil({need.load_rps:g} req/s x {need.residence_s:.3f} s) = "
        f"{need.concurrency} sequences",
        f"KV need at P95 context: {need.concurrency} x {need.context_p95_tokens} tokens x {kib:g} KiB = "
        f"{need.kv_need_bytes / GIB:.2f} GiB ({need.kv_need_tokens} tokens)",
        f"reserve: {need.reserve_fraction:.0%} of each card's memory kept free, and each instance loaded to at most "
        f"{1 - need.reserve_fraction:.0%} of its SLO envelope",
    ]
