"""The per-stage paged KV pool: pre-allocated K and V tensors addressed through block tables.

Layout per stage: ``k[layer, slot, kv_heads, head_dim]`` (same for ``v``) where
``slot = block_id * block_size_tokens + offset`` (see :func:`~flexpipe_dag.runtime.kv_blocks.slot_mapping`).
The pool is allocated once, at stage start or reconfiguration; nothing grows during serving.
Block accounting (which sequence owns which block) lives in
:class:`~flexpipe_dag.runtime.kv_blocks.BlockAllocator` on the scheduler side.
"""

from __future__ import annotations

import torch

from flexpipe_dag.runtime.attention import SlotRows
from flexpipe_dag.runtime.kv_blocks import BlockAllocator, KVCapacityError, blocks_for_tokens, slot_mapping

__all__ = ["BlockAllocator", "KVCapacityError", "PagedKVPool", "blocks_for_tokens", "kv_bytes_per_token",
           "slot_mapping"]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV bytes one token takes over ``num_layers`` layers: ``2 x layers x kv_heads x head_dim x dtype_bytes``
    (DESIGN.md, KV cache arithmetic)."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


class PagedKVPool:
    """K/V block pool of one stage.

    Args:
        num_layers: decoder layers of this stage.
        num_blocks: blocks in the pool (the same on every stage of a pipeline).
        block_size_tokens: tokens per block.
        num_kv_heads, head_dim: attention geometry.
        dtype, device: storage of the pool.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size_tokens: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        shape = (num_layers, num_blocks * block_size_tokens, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        #: each running sequence's slot mapping, kept across steps (see :class:`SlotRows`)
        self.slot_rows = SlotRows(block_size_tokens, self.k.device, num_blocks)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size_tokens

    @property
    def nbytes(self) -> int:
        """Bytes of the pool (K and V)."""
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' keys/values. ``slots``: int64 ``[T]``; ``k``, ``v``: ``[T, kv_heads, head_dim]``."""
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` (int64 ``[L]``), each ``[L, kv_heads, head_dim]``, in slot order."""
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)
