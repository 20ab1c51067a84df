"""Batched attention over the paged KV pool: one attention call per layer for a whole micro-batch.

A micro-batch packs the new tokens of ``S`` sequences into ``T`` rows (prefill chunks of new
sequences, one token of each decoding one). :class:`BatchIndex` is built once per micro-batch and
shared by every layer of the stage:

* ``positions`` ``int64 [T]`` and ``new_slots`` ``int64 [T]`` (where each new token's K/V goes);
* the sequences split into at most two groups, decode (one new token each) and prefill (several),
  each a padded problem: queries ``[S_g, Q_g]`` (``Q_g`` = 1 for decode), context slots
  ``[S_g, L_g]`` (``L_g`` the group's longest context, short rows padded with slot 0) and a boolean
  mask ``[S_g, 1, Q_g, L_g]`` that lets query ``i`` of sequence ``s`` see key ``j`` iff
  ``j <= start_s + i`` and ``j < L_s`` (causal after the cached prefix, nothing past the sequence).

:func:`paged_attention` then gathers each group's keys / values from the pool in one
``index_select`` and calls ``scaled_dot_product_attention`` once (grouped-query attention through
``enable_gqa``, no repeated K/V), so a layer costs at most two attention calls whatever the
micro-batch size (before: one gather and one call per sequence, 2,000+ small kernels per step at
64 sequences x 32 layers). Grouping keeps a decode row from paying for a long prompt's query
length; a group of one sequence needs no padding and uses SDPA's own causal path.

:class:`SlotRows` keeps each sequence's slot mapping as a tensor across steps and appends only the
new tokens' slots (vLLM's ``slot_mapping``), instead of rebuilding every sequence's whole slot list
from its block table in Python at every step.

Layout of the pool: see :mod:`flexpipe_dag.runtime.kv_cache`. The per-sequence loop this replaces is
kept in the tests as the reference the batched path must equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexpipe_dag.runtime.kv_blocks import slot_mapping
from flexpipe_dag.runtime.scheduler import ScheduledSeq

#: Forward passes a sequence's slot row survives unused before :class:`SlotRows` drops it (it is
#: rebuilt from the block table if the sequence comes back).
SLOT_ROW_IDLE_STEPS = 256


@dataclass
class AttentionGroup:
    """One padded attention problem of a micro-batch (decode rows or prefill rows).

    Attributes:
        token_rows: ``int64 [S_g * Q_g]`` rows of the packed ``[T, ...]`` tensors each padded query
            reads (padding repeats a real row of the same sequence).
        valid: ``bool [S_g * Q_g]`` which padded queries are real, or None when all are.
        ctx_slots: ``int64 [S_g, L_g]`` pool slots of each sequence's context (padded with slot 0).
        mask: ``bool [S_g, 1, Q_g, L_g]`` keys each query may see, or None (no padding, plain causal
            or a single new token: see ``causal``).
        causal: with ``mask`` None, whether the group is one whole prompt (causal from position 0).
        num_seqs, q_len, ctx_len: ``S_g``, ``Q_g``, ``L_g``.
    """

    token_rows: torch.Tensor
    valid: torch.Tensor | None
    ctx_slots: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    num_seqs: int
    q_len: int
    ctx_len: int


@dataclass
class BatchIndex:
    """Everything a stage's layers need to know about a micro-batch's layout (built once per step).

    Attributes:
        positions: ``int64 [T]`` position of each new token in its sequence.
        new_slots: ``int64 [T]`` pool slot each new token's K/V is written to.
        last_rows: ``int64 [S]`` row of each sequence's last new token (the one the head samples from).
        groups: the padded attention problems (at most two).
        write_rows: ``int64 [len(new_slots)]`` the row of the packed ``[T, ...]`` tensors whose K/V goes
            to each of ``new_slots``, or None (row ``i`` to ``new_slots[i]``): a micro-batch padded to a
            static shape (:mod:`~flexpipe_dag.runtime.decode_graphs`) writes a real row's K/V again to
            that row's slot for each padding row, never a padding row's own.
    """

    positions: torch.Tensor
    new_slots: torch.Tensor
    last_rows: torch.Tensor
    groups: list[AttentionGroup]
    write_rows: torch.Tensor | None = None


@dataclass
class _Row:
    blocks: list[int]  # the block table the slots were computed from
    slots: torch.Tensor  # int64 [capacity]; the first ``length`` are valid
    length: int
    last_used: int


class SlotRows:
    """Per-sequence slot mappings kept as tensors across steps, extended by the new tokens only.

    A sequence's slots depend only on its block table, which only grows while the sequence runs
    (:class:`~flexpipe_dag.runtime.kv_blocks.BlockAllocator`). A row is reused while the block table
    it was computed from is still a prefix of the sequence's table; otherwise (a recycled id, a
    preempted sequence given new blocks) it is rebuilt from the table. Rows unused for
    :data:`SLOT_ROW_IDLE_STEPS` forward passes are dropped, so memory follows the running set.

    Args:
        block_size_tokens: tokens per KV block.
        device: where the slot tensors live (the pool's device).
    """

    def __init__(self, block_size_tokens: int, device: torch.device | str = "cpu", num_blocks: int | None = None):
        self.block_size_tokens = block_size_tokens
        #: blocks in the pool the slots address (``None``: not checked)
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self._rows: dict[int, _Row] = {}
        self._step = 0
        #: slots computed from block tables since creation (a measure of the incremental saving)
        self.slots_computed = 0

    def __len__(self) -> int:
        return len(self._rows)

    def context_slots(self, seq: ScheduledSeq) -> torch.Tensor:
        """``int64 [start_pos + len(token_ids)]``: the pool slots of positions ``0 .. end - 1`` of ``seq``.

        Raises:
            ValueError: the block table does not cover the positions, or names a block outside the pool
                (a corrupt micro-batch: nothing is written to the pool).
        """
        end = seq.start_pos + len(seq.token_ids)
        row = self._rows.get(seq.seq_id)
        table = seq.block_table
        if end > len(table) * self.block_size_tokens:
            raise ValueError(f"sequence {seq.seq_id}: its block table of {len(table)} block(s) holds "
                             f"{len(table) * self.block_size_tokens} tokens; positions up to {end} need "
                             f"{-(-end // self.block_size_tokens)}")
        if row is None or table[:len(row.blocks)] != row.blocks:
            row = _Row(list(table), torch.empty(max(end, 16), dtype=torch.long, device=self.device), 0, self._step)
            self._rows[seq.seq_id] = row
        elif len(table) != len(row.blocks):
            row.blocks = list(table)
        row.last_used = self._step
        if end > row.length:
            if end > row.slots.numel():
                grown = torch.empty(max(end, 2 * row.slots.numel()), dtype=torch.long, device=self.device)
                grown[:row.length] = row.slots[:row.length]
                row.slots = grown
            new = slot_mapping(table, row.length, end, self.block_size_tokens)
            if self.num_blocks is not None and not 0 <= min(new) <= max(new) < self.num_blocks * self.block_size_tokens:
                bad = [b for b in table if not 0 <= b < self.num_blocks]
                raise ValueError(f"sequence {seq.seq_id}: block(s) {bad[:4]} outside the pool of {self.num_blocks}")
            row.slots[row.length:end] = torch.tensor(new, dtype=torch.long, device=self.device)
            self.slots_computed += len(new)
            row.length = end
        return row.slots[:end]

    def end_step(self) -> None:
        """One forward pass is over: age the rows and drop those idle too long."""
        self._step += 1
        if self._step % 64 == 0:
            old = self._step - SLOT_ROW_IDLE_STEPS
            for seq_id in [s for s, r in self._rows.items() if r.last_used < old]:
                del self._rows[seq_id]


def build_index(seqs: list[ScheduledSeq], rows: SlotRows) -> BatchIndex:
    """The :class:`BatchIndex` of a micro-batch whose sequences are ``seqs`` (packed in this order).

    Raises:
        ValueError: a sequence without new tokens, or a block table that does not cover its positions
            or leaves the pool (:meth:`SlotRows.context_slots`).
    """
    device = rows.device
    ns = [len(s.token_ids) for s in seqs]
    if any(n < 1 for n in ns):
        raise ValueError("every scheduled sequence needs at least one new token")
    ctx = [rows.context_slots(s) for s in seqs]
    starts = [s.start_pos for s in seqs]
    offsets: list[int] = []
    t = 0
    for n in ns:
        offsets.append(t)
        t += n
    n_t = torch.tensor(ns, dtype=torch.long, device=device)
    start_t = torch.tensor(starts, dtype=torch.long, device=device)
    off_t = torch.tensor(offsets, dtype=torch.long, device=device)
    within = torch.arange(t, device=device) - torch.repeat_interleave(off_t, n_t)
    positions = torch.repeat_interleave(start_t, n_t) + within
    new_slots = torch.cat([c[s:] for c, s in zip(ctx, starts)]) if len(seqs) > 1 else ctx[0][starts[0]:]
    last_rows = off_t + n_t - 1
    decode = [i for i, n in enumerate(ns) if n == 1]
    prefill = [i for i, n in enumerate(ns) if n > 1]
    groups = [_group(idx, ns, starts, offsets, ctx, device) for idx in (decode, prefill) if idx]
    return BatchIndex(positions, new_slots, last_rows, groups)


def _group(idx: list[int], ns: list[int], starts: list[int], offsets: list[int], ctx: list[torch.Tensor],
           device: torch.device) -> AttentionGroup:
    s_g = len(idx)
    q_len = max(ns[i] for i in idx)
    lens = [starts[i] + ns[i] for i in idx]
    ctx_len = max(lens)
    if s_g == 1:
        i = idx[0]
        rows = torch.arange(offsets[i], offsets[i] + ns[i], device=device)
        causal = starts[i] == 0 and ns[i] > 1
        mask = None
        if starts[i] > 0 and ns[i] > 1:  # new tokens after a cached prefix: causal with an offset
            mask = torch.ones(ns[i], ctx_len, dtype=torch.bool, device=device).tril(ctx_len - ns[i])[None, None]
        return AttentionGroup(rows, None, ctx[i][None], mask, causal, 1, q_len, ctx_len)
    ctx_slots = torch.nn.utils.rnn.pad_sequence([ctx[i] for i in idx], batch_first=True, padding_value=0)
    n_g = torch.tensor([ns[i] for i in idx], dtype=torch.long, device=device)
    start_g = torch.tensor([starts[i] for i in idx], dtype=torch.long, device=device)
    len_g = start_g + n_g
    q_pos = torch.arange(q_len, device=device)
    k_pos = torch.arange(ctx_len, device=device)
    if q_len == 1:  # decode: every key of the sequence, none past it
        mask = (k_pos[None, :] < len_g[:, None])[:, None, None, :]
        return AttentionGroup(torch.tensor([offsets[i] for i in idx], dtype=torch.long, device=device), None,
                              ctx_slots, mask, False, s_g, 1, ctx_len)
    valid2 = q_pos[None, :] < n_g[:, None]  # [S_g, Q]
    q_clamped = torch.minimum(q_pos[None, :], n_g[:, None] - 1)  # padding repeats the sequence's last row
    token_rows = torch.tensor([offsets[i] for i in idx], dtype=torch.long, device=device)[:, None] + q_clamped
    q_abs = start_g[:, None] + q_clamped  # [S_g, Q] absolute position of each (padded) query
    mask = (k_pos[None, None, :] <= q_abs[:, :, None]) & (k_pos[None, None, :] < len_g[:, None, None])
    return AttentionGroup(token_rows.reshape(-1), valid2.reshape(-1), ctx_slots, mask[:, None], False, s_g, q_len,
                          ctx_len)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: BatchIndex,
                    scale: float) -> torch.Tensor:
    """Attention of a micro-batch's new tokens over their sequences' cached keys / values.

    Args:
        q: ``[T, heads, head_dim]`` queries of the packed new tokens (rotary applied).
        k_cache, v_cache: ``[slots, kv_heads, head_dim]`` one layer of the pool, the new tokens' K/V
            already written.
        index: the micro-batch's :class:`BatchIndex`.
        scale: softmax scale (``1 / sqrt(head_dim)`` for Llama).

    Returns:
        ``[T, heads * head_dim]`` attention outputs in packed order.
    """
    t, heads, d = q.shape
    out = q.new_empty(t, heads * d)
    for g in index.groups:
        kv_heads = k_cache.shape[1]
        flat = g.ctx_slots.reshape(-1)
        kc = k_cache.index_select(0, flat).view(g.num_seqs, g.ctx_len, kv_heads, d).transpose(1, 2)
        vc = v_cache.index_select(0, flat).view(g.num_seqs, g.ctx_len, kv_heads, d).transpose(1, 2)
        qg = q.index_select(0, g.token_rows).view(g.num_seqs, g.q_len, heads, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=g.mask, is_causal=g.causal, scale=scale,
                                           enable_gqa=heads != kv_heads)
        o = o.transpose(1, 2).reshape(g.num_seqs * g.q_len, heads * d)
        if g.valid is None:
            out.index_copy_(0, g.token_rows, o)
        else:
            out.index_copy_(0, g.token_rows[g.valid], o[g.valid])
    return out
