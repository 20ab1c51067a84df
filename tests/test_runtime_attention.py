"""Batched paged attention equals the per-sequence reference; slot rows grow incrementally."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from flexpipe_dag.runtime.attention import SLOT_ROW_IDLE_STEPS, SlotRows, build_index, paged_attention  # noqa: E402
from flexpipe_dag.runtime.kv_blocks import BlockAllocator, slot_mapping  # noqa: E402
from flexpipe_dag.runtime.scheduler import ScheduledSeq  # noqa: E402

BLOCK = 4


def reference_attention(q, k_cache, v_cache, seqs: list[ScheduledSeq], scale: float):
    """The per-sequence loop the stage ran before: one gather and one SDPA call per sequence."""
    heads, d = q.shape[1], q.shape[2]
    groups = heads // k_cache.shape[1]
    outs, row = [], 0
    for s in seqs:
        n = len(s.token_ids)
        slots = torch.tensor(slot_mapping(s.block_table, 0, s.start_pos + n, BLOCK))
        kc = k_cache.index_select(0, slots).transpose(0, 1).repeat_interleave(groups, 0)[None]
        vc = v_cache.index_select(0, slots).transpose(0, 1).repeat_interleave(groups, 0)[None]
        qs = q[row:row + n].transpose(0, 1)[None]
        ctx = slots.shape[0]
        if n == ctx:
            o = F.scaled_dot_product_attention(qs, kc, vc, is_causal=n > 1, scale=scale)
        elif n == 1:
            o = F.scaled_dot_product_attention(qs, kc, vc, scale=scale)
        else:
            mask = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)
            o = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=mask, scale=scale)
        outs.append(o[0].transpose(0, 1).reshape(n, heads * d))
        row += n
    return torch.cat(outs)


def _micro_batch(rng: random.Random, alloc: BlockAllocator, shapes: list[tuple[int, int]]) -> list[ScheduledSeq]:
    """Sequences of ``(cached, new)`` tokens with block tables from a real allocator (blocks scattered)."""
    seqs = []
    for i, (cached, new) in enumerate(shapes):
        seq_id = 1000 * i + rng.randrange(1000)  # unique, not in order
        alloc.reserve(seq_id, cached + new)
        table = alloc.append(seq_id, cached + new)
        seqs.append(ScheduledSeq(seq_id, [1] * new, cached, table, 0))
    return seqs


@pytest.mark.parametrize("shapes", [
    [(7, 1), (0, 1), (30, 1), (12, 1)],  # decode only (a first token decoded from an empty cache too)
    [(0, 9), (0, 3), (0, 17)],  # whole prompts only
    [(5, 6), (0, 4)],  # a prompt after a cached prefix (chunked prefill) next to a whole one
    [(11, 1), (0, 13), (3, 1), (8, 5), (0, 1), (21, 1)],  # mixed
    [(0, 6)], [(14, 1)], [(9, 4)],  # one sequence of each kind
])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4)])
def test_batched_paged_attention_equals_the_per_sequence_reference(shapes, heads, kv_heads):
    rng = random.Random(len(shapes) * 31 + heads)
    torch.manual_seed(rng.randrange(1000))
    d = 8
    alloc = BlockAllocator(64, BLOCK)
    for junk in range(5):  # take some blocks first, so tables are not 0, 1, 2, ...
        alloc.reserve(-1 - junk, rng.randrange(1, 9))
        alloc.append(-1 - junk, 1)
    seqs = _micro_batch(rng, alloc, shapes)
    k_cache = torch.randn(64 * BLOCK, kv_heads, d)
    v_cache = torch.randn(64 * BLOCK, kv_heads, d)
    t = sum(len(s.token_ids) for s in seqs)
    q = torch.randn(t, heads, d)
    index = build_index(seqs, SlotRows(BLOCK))
    got = paged_attention(q, k_cache, v_cache, index, scale=d ** -0.5)
    want = reference_attention(q, k_cache, v_cache, seqs, scale=d ** -0.5)
    assert got.shape == (t, heads * d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(index.groups) == len({len(s.token_ids) > 1 for s in seqs})  # at most decode + prefill
    expected_positions = [p for s in seqs for p in range(s.start_pos, s.start_pos + len(s.token_ids))]
    assert index.positions.tolist() == expected_positions
    assert index.new_slots.tolist() == [x for s in seqs for x in slot_mapping(
        s.block_table, s.start_pos, s.start_pos + len(s.token_ids), BLOCK)]


def test_slot_rows_append_only_the_new_tokens_and_rebuild_a_changed_table():
    alloc = BlockAllocator(32, BLOCK)
    alloc.reserve(7, 40)
    rows = SlotRows(BLOCK)
    table = alloc.append(7, 10)
    assert rows.context_slots(ScheduledSeq(7, [1] * 10, 0, table, 0)).tolist() == slot_mapping(table, 0, 10, BLOCK)
    assert rows.slots_computed == 10
    for pos in range(10, 30):  # decode: one new slot per step, the row grows past its first capacity
        table = alloc.append(7, 1)
        got = rows.context_slots(ScheduledSeq(7, [1], pos, table, 0))
        assert got.tolist() == slot_mapping(table, 0, pos + 1, BLOCK)
        rows.end_step()
    assert rows.slots_computed == 30  # each slot computed once
    alloc.free(7)
    alloc.reserve(7, 8)  # the same id again with other blocks (a recycled id, or a preempted sequence)
    other = alloc.append(7, 8)
    assert rows.context_slots(ScheduledSeq(7, [1] * 8, 0, other, 0)).tolist() == slot_mapping(other, 0, 8, BLOCK)
    assert len(rows) == 1
    for _ in range(SLOT_ROW_IDLE_STEPS + 64):
        rows.end_step()
    assert len(rows) == 0  # idle rows are dropped


def test_a_sequence_without_new_tokens_is_refused():
    with pytest.raises(ValueError, match="at least one new token"):
        build_index([ScheduledSeq(1, [], 0, [0], 0)], SlotRows(BLOCK))


def test_a_block_table_that_does_not_cover_the_positions_or_leaves_the_pool_is_refused():
    rows = SlotRows(BLOCK, num_blocks=4)
    with pytest.raises(ValueError, match=r"block table of 1 block\(s\) holds 4 tokens; positions up to 5 need 2"):
        build_index([ScheduledSeq(1, [1] * 5, 0, [0], 0)], rows)
    with pytest.raises(ValueError, match=r"block\(s\) \[9\] outside the pool of 4"):
        build_index([ScheduledSeq(2, [1] * 3, 0, [9], 0)], rows)
    assert len(rows) == 0 or all(r.length == 0 for r in rows._rows.values())  # nothing half-recorded
