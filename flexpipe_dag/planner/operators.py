"""Operator-level work (FLOPs and bytes moved) of one transformer layer, by operator class.

The cost model prices each operator with a roofline of its class (see ``cost_model``), and the
calibration fits those classes against measured operator times, so both use these same counts.

Operator names follow the vidur profiler (microsoft/vidur, ``profiling/mlp``): ``emb``,
``input_layernorm``, ``attn_pre_proj`` (fused QKV), ``attn_rope``, ``attn_post_proj`` (O),
``post_attention_layernorm``, ``mlp_up_proj`` (fused gate+up), ``mlp_act`` (SiLU x up),
``mlp_down_proj``, ``add`` (residual); plus ``attn_core`` (QK^T, softmax, x V) which that profile
does not measure.

Counting rules (multiply-add = 2 FLOPs; bytes = every operand read once and the result written once):

* GEMM ``[n, K] x [K, N]``: ``2 n K N`` FLOPs, ``K N w + n K a + n N a`` bytes
  (``w`` weight bytes/element, ``a`` activation bytes/element).
* attention core: ``4 x q_dim x pairs`` FLOPs (QK^T and P x V, Hoffmann et al. 2022 App. F),
  bytes = K and V of every cached token read once + Q in, output out.
* RMSNorm ``[n, h]``: ``4 n h`` FLOPs, ``2 n h a + h a`` bytes; residual add: ``n h`` FLOPs,
  ``3 n h a`` bytes; RoPE on Q and K: ``6 n (q+k)`` FLOPs, ``2 n (q+k) a`` bytes;
  SiLU-and-multiply: ``5 n I`` FLOPs, ``3 n I a`` bytes; embedding gather: ``2 n h a`` bytes.

With tensor parallelism ``tp`` the head and MLP dimensions are split ``tp`` ways (Megatron-LM),
norms, adds and the embedding are not (vidur profiles them unsplit).
"""

from __future__ import annotations

from dataclasses import dataclass

from flexpipe_dag.planner.model_spec import ModelSpec, dtype_bytes, kv_dtype_bytes

#: Operator classes; each gets its own efficiency factors in the cost model.
#: ``residual`` (the residual add) is its own class: it streams at about twice the bandwidth of the
#: other elementwise kernels (RoPE, SiLU-and-multiply) on the measured A100, and one shared class
#: mispredicted it by ~60 % (``bench/calibration_bench.py``).
OP_CLASSES: tuple[str, ...] = ("gemm", "attention", "norm", "elementwise", "residual", "embedding")

#: vidur operator name -> operator class.
VIDUR_OP_CLASS: dict[str, str] = {
    "emb": "embedding", "input_layernorm": "norm", "attn_pre_proj": "gemm", "attn_rope": "elementwise",
    "attn_post_proj": "gemm", "post_attention_layernorm": "norm", "mlp_up_proj": "gemm",
    "mlp_act": "elementwise", "mlp_down_proj": "gemm", "add": "residual",
}


@dataclass(frozen=True)
class OpWork:
    """Work of one operator invocation: ``flops`` (FLOP) and ``bytes_moved`` (bytes) on one device."""

    name: str
    op_class: str
    flops: float
    bytes_moved: float


def _gemm(name: str, n: float, k: float, m: float, w: float, a: float) -> OpWork:
    return OpWork(name, "gemm", 2.0 * n * k * m, k * m * w + n * k * a + n * m * a)


def operator_work(spec: ModelSpec, op_name: str, num_tokens: float, dtype: str = "bf16", tp: int = 1) -> OpWork:
    """Work of one named per-token operator (the vidur set above) for ``num_tokens`` tokens.

    Raises:
        KeyError: ``op_name`` is not one of :data:`VIDUR_OP_CLASS`.
    """
    n, h = float(num_tokens), float(spec.hidden_size)
    w, a = dtype_bytes(dtype), kv_dtype_bytes(dtype)
    q, kv = spec.q_dim / tp, spec.kv_dim / tp
    inter = spec.intermediate_size / tp
    if op_name == "emb":
        return OpWork(op_name, "embedding", 0.0, 2 * n * h * a)
    if op_name in ("input_layernorm", "post_attention_layernorm"):
        return OpWork(op_name, "norm", 4 * n * h, 2 * n * h * a + h * a)
    if op_name == "attn_pre_proj":
        return _gemm(op_name, n, h, q + 2 * kv, w, a)
    if op_name == "attn_rope":
        return OpWork(op_name, "elementwise", 6 * n * (q + kv), 2 * n * (q + kv) * a)
    if op_name == "attn_post_proj":
        return _gemm(op_name, n, q, h, w, a)
    if op_name == "mlp_up_proj":
        return _gemm(op_name, n, h, (2 if spec.gated_mlp else 1) * inter, w, a)
    if op_name == "mlp_act":
        return OpWork(op_name, "elementwise", 5 * n * inter, 3 * n * inter * a)
    if op_name == "mlp_down_proj":
        return _gemm(op_name, n, inter, h, w, a)
    if op_name == "add":
        return OpWork(op_name, "residual", n * h, 3 * n * h * a)
    raise KeyError(op_name)


#: Operators of one decoder layer in execution order (``add`` appears twice: two residuals).
LAYER_OPS: tuple[str, ...] = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "add",
                              "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


def attention_core_work(spec: ModelSpec, num_tokens: float, attended_pairs: float, kv_tokens_read: float,
                        dtype: str = "bf16", tp: int = 1) -> OpWork:
    """QK^T, softmax and P x V for ``num_tokens`` queries.

    Args:
        attended_pairs: sum over query tokens of the keys each attends to (``n (n+1) / 2`` for a causal
            prompt of ``n``; the total context for a decode batch).
        kv_tokens_read: cached tokens whose K and V are read (``n`` for a prompt, the total context for decode).
    """
    a = kv_dtype_bytes(dtype)
    q, kv = spec.q_dim / tp, spec.kv_dim / tp
    flops = 4.0 * q * attended_pairs
    moved = kv_tokens_read * 2 * kv * a + 2 * num_tokens * q * a
    return OpWork("attn_core", "attention", flops, moved)


def layer_work_by_class(spec: ModelSpec, num_tokens: float, attended_pairs: float, kv_tokens_read: float,
                        dtype: str = "bf16") -> dict[str, tuple[float, float, int]]:
    """One decoder layer's work summed per operator class: ``{class: (flops, bytes, num_kernels)}``."""
    out: dict[str, list[float]] = {}
    ops = [operator_work(spec, name, num_tokens, dtype) for name in LAYER_OPS]
    ops.append(attention_core_work(spec, num_tokens, attended_pairs, kv_tokens_read, dtype))
    for op in ops:
        acc = out.setdefault(op.op_class, [0.0, 0.0, 0])
        acc[0] += op.flops
        acc[1] += op.bytes_moved
        acc[2] += 1
    return {k: (v[0], v[1], int(v[2])) for k, v in out.items()}


def head_work_by_class(spec: ModelSpec, num_logit_tokens: float, dtype: str = "bf16") -> dict[str, tuple[float, float, int]]:
    """Final norm + LM head for ``num_logit_tokens`` tokens that need logits (LM head kept 16-bit)."""
    a = kv_dtype_bytes(dtype)
    h = float(spec.hidden_size)
    norm = (4 * num_logit_tokens * h, 2 * num_logit_tokens * h * a + h * a, 1)
    g = _gemm("lm_head", num_logit_tokens, h, spec.vocab_size, max(2.0, min(dtype_bytes(dtype), 4.0)), a)
    return {"norm": norm, "gemm": (g.flops, g.bytes_moved, 1)}


def embedding_work_by_class(spec: ModelSpec, num_tokens: float, dtype: str = "bf16") -> dict[str, tuple[float, float, int]]:
    """Embedding gather for ``num_tokens`` tokens."""
    op = operator_work(spec, "emb", num_tokens, dtype)
    return {"embedding": (op.flops, op.bytes_moved, 1)}
