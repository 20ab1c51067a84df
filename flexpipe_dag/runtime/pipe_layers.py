"""A Llama checkpoint as a DeepSpeed ``PipelineModule``, partitioned exactly as a gear says.

Layer list (``PipelineModule`` indices): ``0`` the embedding, ``1..L`` the decoder layers,
``L + 1`` the final norm + LM head. A gear stage covering decoder layers ``[a, b)`` owns list
entries ``[a + 1, b + 1)``, plus entry 0 on the first stage and entry ``L + 1`` on the last
(:func:`gear_parts`). DeepSpeed builds only a rank's own entries (``LayerSpec`` is built lazily),
and every layer reads only its own tensors from the safetensors files, so a stage holds its
layers and nothing else.

Forward is the plain dense causal forward over right-padded ``[batch, seq]`` token ids: with a
causal mask and positions ``0..seq-1`` the padding at the end changes no real position's logits,
so no attention mask travels between stages (one activation tensor ``[batch, seq, hidden]``).
Attention uses the Hugging Face Llama layer's own modules and ``scaled_dot_product_attention``
(``is_causal=True``), as transformers' ``sdpa`` path does.

DeepSpeed gotchas handled here (see DeepSpeed ``runtime/pipe/module.py``): an explicit uneven
split is not one of ``PipelineModule``'s partition methods, so :class:`GearPipelineModule`
overrides ``_partition_layers`` to set ``self.parts`` and call ``_set_bounds``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from flexpipe_dag.runtime.model_loader import Checkpoint, stage_tensor_names, torch_dtype
from flexpipe_dag.runtime.scoring import gear_parts


def _load(ckpt: Checkpoint, names: dict[str, str], dtype: str) -> dict[str, torch.Tensor]:
    """Module parameter name -> tensor, reading only ``names``' stored tensors."""
    from safetensors import safe_open

    target = torch_dtype(dtype)
    by_file: dict = {}
    for param, stored in names.items():
        by_file.setdefault(ckpt.tensor_files[stored], []).append((param, stored))
    out = {}
    for f, pairs in by_file.items():
        with safe_open(str(f), framework="pt") as fh:
            for param, stored in pairs:
                out[param] = fh.get_tensor(stored).to(target)
    return out


def _assign(module: nn.Module, state: dict[str, torch.Tensor], where: str) -> nn.Module:
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise RuntimeError(f"{where}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    return module.eval()


class EmbeddingPipe(nn.Module):
    """Entry 0: token ids ``int64 [B, T]`` -> hidden states ``[B, T, hidden]``."""

    def __init__(self, ckpt: Checkpoint, dtype: str = "fp32"):
        super().__init__()
        cfg = ckpt.config
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        _assign(self, {"embed_tokens.weight": _load(ckpt, {"w": "model.embed_tokens.weight"}, dtype)["w"]},
                "embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class DecoderLayerPipe(nn.Module):
    """Entry ``i + 1``: decoder layer ``i``, dense causal self-attention over ``[B, T, hidden]``."""

    def __init__(self, ckpt: Checkpoint, layer_index: int, dtype: str = "fp32"):
        super().__init__()
        cfg = ckpt.config
        self.layer_index = layer_index
        with torch.device("meta"):
            self.layer = LlamaDecoderLayer(cfg, layer_idx=layer_index)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)
        names = {k.replace("layers.0.", "layer.", 1): v for k, v in
                 stage_tensor_names(ckpt, layer_index, layer_index + 1, first=False, last=False).items()}
        _assign(self, _load(ckpt, names, dtype), f"decoder layer {layer_index}")
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # the config fills num_key_value_heads in (None: one per attention head, HF's own default)
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        positions = torch.arange(t, device=h.device)[None].expand(b, t)
        cos, sin = self.rotary_emb(h, positions)
        attn = self.layer.self_attn
        x = self.layer.input_layernorm(h)
        q = attn.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        o = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=t > 1,
                                           scale=attn.scaling)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))


class HeadPipe(nn.Module):
    """Entry ``L + 1``: final RMSNorm + LM head, ``[B, T, hidden]`` -> logits ``[B, T, vocab]``.

    A tied head reads the embedding matrix (a separate copy on the last stage: no tied-weight
    communication is needed for inference)."""

    def __init__(self, ckpt: Checkpoint, dtype: str = "fp32"):
        super().__init__()
        cfg = ckpt.config
        with torch.device("meta"):
            self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        head = "lm_head.weight" if "lm_head.weight" in ckpt.tensor_files else "model.embed_tokens.weight"
        _assign(self, _load(ckpt, {"norm.weight": "model.norm.weight", "lm_head.weight": head}, dtype), "head")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token: ``[B, T, vocab]``, ``[B, T]`` -> ``[B, T - 1]`` (fp32).

    Entry ``[b, j]`` is ``log p(input_ids[b, j + 1] | input_ids[b, :j + 1])``. Used as the
    pipeline's ``loss_fn`` so the per-token scores, not the logits, leave the last stage.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None].to(logp.device)).squeeze(-1)


def layer_specs(ckpt: Checkpoint, dtype: str = "fp32") -> list:
    """The ``LayerSpec`` list of the whole model (nothing is built until DeepSpeed partitions it)."""
    from deepspeed.pipe import LayerSpec

    return ([LayerSpec(EmbeddingPipe, ckpt, dtype)]
            + [LayerSpec(DecoderLayerPipe, ckpt, i, dtype) for i in range(ckpt.num_layers)]
            + [LayerSpec(HeadPipe, ckpt, dtype)])


def gear_pipeline_module(ckpt: Checkpoint, layer_ranges: list[tuple[int, int]], dtype: str = "fp32"):
    """A ``deepspeed.pipe.PipelineModule`` split at the gear's layer ranges (one rank per stage).

    Needs ``deepspeed.comm`` initialised with ``world_size == len(layer_ranges)``; builds only
    this rank's layers. ``loss_fn`` is :func:`next_token_logprobs`; ``dynamic_shape=True`` lets
    every ``eval_batch`` use its own sequence length.
    """
    from deepspeed.pipe import PipelineModule

    parts = gear_parts(layer_ranges)

    class GearPipelineModule(PipelineModule):
        def _partition_layers(self, method="uniform"):
            if len(parts) != self.num_stages + 1 or parts[-1] != len(self._layer_specs):
                raise ValueError(f"gear parts {parts} do not fit {self.num_stages} stages of "
                                 f"{len(self._layer_specs)} pipeline layers")
            self.parts = list(parts)
            stage_id = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    return GearPipelineModule(layers=layer_specs(ckpt, dtype), num_stages=len(layer_ranges),
                              loss_fn=next_token_logprobs, partition_method="gear", dynamic_shape=True)
