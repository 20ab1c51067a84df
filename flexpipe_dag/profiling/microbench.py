"""Torch microbenchmarks one device (a GPU, or a CPU worker process standing in for one) runs on itself.

All functions take a ``torch.device`` and return measured figures with units in their names. They
synchronise CUDA around timed regions and report the median of several repetitions.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Layer shape used to time attention / MLP when no model is given: SmolLM2-135M's decoder layer.
DEFAULT_LAYER = {"hidden_size": 576, "num_heads": 9, "num_kv_heads": 3, "intermediate_size": 1536}


@dataclass(frozen=True)
class LayerShape:
    """A Llama-style decoder layer's dimensions."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(device: torch.device, fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` on ``device`` in ms (CUDA synchronised)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gemm_tflops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """Achieved dense matmul TFLOP/s for an ``n x n @ n x n`` product (2 n^3 FLOPs)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(device, lambda: a @ b)
    return 2 * n**3 / (ms / 1e3) / 1e12


def memory_bandwidth_gbps(device: torch.device, num_bytes: int) -> float:
    """Achieved memory bandwidth of a device-to-device copy, GB/s (counts read + write bytes)."""
    import torch

    src = torch.empty(num_bytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    ms = time_ms(device, lambda: dst.copy_(src))
    return 2 * num_bytes / (ms / 1e3) / 1e9


#: Weight size of :func:`weight_read_gbps`: large enough to leave a CPU's caches.
WEIGHT_READ_BYTES = 64 * 2**20


def weight_read_gbps(device: torch.device, dtype: torch.dtype, rows: int, num_bytes: int = WEIGHT_READ_BYTES) -> float:
    """Weight bytes per second, GB/s, of ``rows`` activation rows times a square weight of about ``num_bytes``
    (``[rows, k] @ [k, k]``): what a decode step of ``rows`` sequences reaches reading its weights.

    ``rows`` below 1 counts as 1.
    """
    import torch

    k = int((num_bytes / torch.empty((), dtype=dtype).element_size()) ** 0.5)
    weight = torch.randn(k, k, device=device, dtype=dtype)
    x = torch.randn(max(1, rows), k, device=device, dtype=dtype)
    ms = time_ms(device, lambda: x @ weight)
    return weight.numel() * weight.element_size() / (ms / 1e3) / 1e9


def layer_times_ms(device: torch.device, dtype: torch.dtype, shape: LayerShape,
                   token_counts: list[int]) -> dict[str, float]:
    """Time attention (QKV/O projections + SDPA, causal) and gated MLP of one layer at each token count.

    Returns ``{"attention_t{N}": ms, "mlp_t{N}": ms, ...}``: one sequence of N tokens (prefill shape).
    """
    import torch
    import torch.nn.functional as F

    h, d = shape.hidden_size, shape.head_dim
    kv = shape.num_kv_heads * d
    w = {name: torch.randn(o, i, device=device, dtype=dtype) * 0.02 for name, (o, i) in {
        "q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h),
        "gate": (shape.intermediate_size, h), "up": (shape.intermediate_size, h), "down": (h, shape.intermediate_size),
    }.items()}
    out: dict[str, float] = {}
    with torch.inference_mode():
        for n in token_counts:
            x = torch.randn(1, n, h, device=device, dtype=dtype)

            def attention(x: torch.Tensor = x, n: int = n) -> torch.Tensor:
                q = F.linear(x, w["q"]).view(1, n, shape.num_heads, d).transpose(1, 2)
                k = F.linear(x, w["k"]).view(1, n, shape.num_kv_heads, d).transpose(1, 2)
                v = F.linear(x, w["v"]).view(1, n, shape.num_kv_heads, d).transpose(1, 2)
                rep = shape.num_heads // shape.num_kv_heads
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return F.linear(a.transpose(1, 2).reshape(1, n, h), w["o"])

            def mlp(x: torch.Tensor = x) -> torch.Tensor:
                return F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"])

            out[f"attention_t{n}"] = time_ms(device, attention)
            out[f"mlp_t{n}"] = time_ms(device, mlp)
    return out


def activation_bytes_per_sequence(shape: LayerShape, context_tokens: int, dtype_bytes: int) -> int:
    """Peak live activation bytes of one sequence in one layer's forward (prefill of ``context_tokens``).

    Counts the residual stream, Q/K/V, the attention score matrix (eager attention, heads x n x n)
    and the gated MLP's two intermediate tensors.
    """
    n, h = context_tokens, shape.hidden_size
    kv = shape.num_kv_heads * shape.head_dim
    elems = 2 * n * h + n * (h + 2 * kv) + shape.num_heads * n * n + 2 * n * shape.intermediate_size
    return elems * dtype_bytes


def max_micro_batch(device: torch.device, dtype: torch.dtype, shape: LayerShape, context_tokens: int,
                    memory_budget_bytes: int, cap: int = 1024) -> tuple[int, str]:
    """Largest micro-batch (sequences of ``context_tokens``) one layer's forward fits in.

    On CUDA this is found for real: doubling then bisection, catching ``torch.cuda.OutOfMemoryError``.
    On a CPU worker an out-of-memory would take the host down, so it is computed from the measured
    layer shape: ``memory_budget_bytes // activation_bytes_per_sequence``. Returns ``(batch, method)``.
    """
    import torch

    if device.type != "cuda":
        per_seq = activation_bytes_per_sequence(shape, context_tokens, torch.finfo(dtype).bits // 8)
        return max(0, min(cap, memory_budget_bytes // per_seq)), "estimated from activation bytes"

    h = shape.hidden_size

    def fits(b: int) -> bool:
        try:
            x = torch.randn(b, context_tokens, h, device=device, dtype=dtype)
            w = torch.randn(shape.intermediate_size, h, device=device, dtype=dtype)
            y = torch.nn.functional.linear(x, w)
            q = x.view(b, context_tokens, shape.num_heads, shape.head_dim).transpose(1, 2)
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            del x, w, y, q
            torch.cuda.synchronize(device)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            torch.cuda.empty_cache()

    lo, hi = 0, 1
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, "measured (doubling + bisection to OOM)"
