"""Stage compute: forward of one packed micro-batch through one stage's layers, with the paged KV pool.

A micro-batch packs the new tokens of several sequences (prefill of new ones and decode of running
ones) into one ``[T, hidden]`` tensor, vLLM-style: projections, norms and MLPs run once over all
``T`` tokens; attention runs batched over the paged pool (:mod:`flexpipe_dag.runtime.attention`:
at most two ``scaled_dot_product_attention`` calls per layer, keys / values gathered through the
sequences' slot rows). The layer arithmetic is the Hugging Face Llama layer's, using its own
modules (``LlamaDecoderLayer``, ``LlamaRotaryEmbedding``, ``apply_rotary_pos_emb``) and
``torch.nn.functional.scaled_dot_product_attention`` as HF's ``sdpa`` path does.

Single process, no communication: chaining stages in one process reproduces HF greedy output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from flexpipe_dag.runtime.attention import BatchIndex, build_index, paged_attention
from flexpipe_dag.runtime.kv_cache import PagedKVPool
from flexpipe_dag.runtime.scheduler import MicroBatch
from flexpipe_dag.runtime.transport import batch_input_ids  # noqa: F401 - re-exported (the driver's input)

if TYPE_CHECKING:
    from flexpipe_dag.runtime.decode_graphs import DecodeGraphs


class StageModule(nn.Module):
    """Decoder layers ``[layer_start, layer_end)`` of a Llama model, plus embedding / norm + head.

    Build it with :func:`flexpipe_dag.runtime.model_loader.load_stage_module` (only this stage's
    tensors are read). ``forward`` input: token ids ``int64 [T]`` on the first stage, hidden states
    ``[T, hidden]`` otherwise; output: hidden states ``[T, hidden]``, or on the last stage logits
    ``[num_seqs, vocab]`` of each sequence's last new token.
    """

    def __init__(self, config, layer_start: int, layer_end: int, *, first: bool, last: bool):
        super().__init__()
        self.config = config
        self.layer_start, self.layer_end = layer_start, layer_end
        self.first, self.last = first, last
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if first else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, layer_idx=i) for i in range(layer_start, layer_end))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps) if last else None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if last else None
        self.rotary_emb: LlamaRotaryEmbedding | None = None
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads

    def make_rotary(self) -> LlamaRotaryEmbedding:
        return LlamaRotaryEmbedding(self.config)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def param_bytes(self) -> int:
        """Bytes of this stage's parameters (a tied LM head counted once)."""
        seen: set[int] = set()
        total = 0
        for p in self.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total

    def new_kv_pool(self, num_blocks: int, block_size_tokens: int) -> PagedKVPool:
        """A pool for this stage's layers, in the parameters' dtype and device."""
        p = next(self.parameters())
        return PagedKVPool(self.num_layers, num_blocks, block_size_tokens, self.num_kv_heads, self.head_dim,
                           dtype=p.dtype, device=p.device)

    @torch.inference_mode()
    def forward(self, batch: MicroBatch, x: torch.Tensor, pool: PagedKVPool,
                graphs: DecodeGraphs | None = None) -> torch.Tensor:
        """The stage's output for ``batch`` (see the class); ``graphs``: run a micro-batch of decodes
        only at a padded static shape, replaying a CUDA graph (:class:`DecodeGraphs`; None: never)."""
        if self.rotary_emb is None:
            raise RuntimeError("StageModule has no rotary embedding: build it with load_stage_module")
        index = build_index(batch.seqs, pool.slot_rows)
        if graphs is not None and graphs.accepts(index):
            out = graphs.run(x, index)
        else:
            out = self.forward_index(x, index, pool)
        pool.slot_rows.end_step()
        return out

    def forward_index(self, x: torch.Tensor, index: BatchIndex, pool: PagedKVPool) -> torch.Tensor:
        """:meth:`forward` of a micro-batch whose layout ``index`` is built (``x``: ``[T]`` token ids or
        ``[T, hidden]``; the output as :meth:`forward`'s, one head row per ``index.last_rows``). Pure
        tensor work on ``x``, ``index`` and the pool, so it can be captured in a CUDA graph."""
        assert self.rotary_emb is not None
        device = pool.k.device
        if self.embed_tokens is not None:  # the first stage (embed_tokens is set exactly when first)
            h = self.embed_tokens(x.to(device))
        else:
            h = x.to(device=device, dtype=pool.k.dtype)
        cos, sin = self.rotary_emb(h[None], index.positions[None])  # [1, T, head_dim]
        for li, layer in enumerate(self.decoder_layers()):
            residual = h
            h = residual + self._attention(li, layer.self_attn, layer.input_layernorm(h), cos, sin, index, pool)
            residual = h
            h = residual + layer.mlp(layer.post_attention_layernorm(h))
        if self.norm is None or self.lm_head is None:  # not the last stage (both are set exactly when last)
            return h
        return self.lm_head(self.norm(h.index_select(0, index.last_rows)))

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """This stage's decoder layers, typed (``nn.ModuleList`` iterates as plain modules)."""
        return [cast(LlamaDecoderLayer, layer) for layer in self.layers]

    def _attention(self, li: int, attn, hn: torch.Tensor, cos, sin, index: BatchIndex,
                   pool: PagedKVPool) -> torch.Tensor:
        t = hn.shape[0]
        q = attn.q_proj(hn).view(1, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(hn).view(1, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(hn).view(1, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_new, v_new = k[0].transpose(0, 1), v[0].transpose(0, 1)
        if index.write_rows is not None:  # padded rows write copies of a real row's K/V to its slot
            k_new, v_new = k_new.index_select(0, index.write_rows), v_new.index_select(0, index.write_rows)
        pool.write(li, index.new_slots, k_new, v_new)
        o = paged_attention(q[0].transpose(0, 1), pool.k[li], pool.v[li], index, attn.scaling)
        return attn.o_proj(o)
