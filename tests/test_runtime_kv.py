"""Paged KV cache: block accounting, pool read/write, and attention through block tables vs HF."""

from __future__ import annotations

import pytest

from flexpipe_dag.runtime.kv_blocks import BlockAllocator, KVCapacityError, blocks_for_tokens, slot_mapping


def test_alloc_on_append_and_free_on_finish():
    a = BlockAllocator(num_blocks=8, block_size_tokens=4)
    assert a.capacity_tokens == 32
    a.reserve(1, 10)  # 3 blocks reserved
    assert a.num_used_blocks == 0 and a.num_reserved_blocks == 3
    assert a.append(1, 5) == [0, 1]
    assert a.append(1, 3) == [0, 1]
    assert a.append(1, 1) == [0, 1, 2]
    with pytest.raises(KVCapacityError):
        a.append(1, 4)  # beyond its reservation
    a.free(1)
    assert a.num_used_blocks == 0 and a.num_reserved_blocks == 0


def test_refusal_when_reservations_exhaust_the_pool():
    a = BlockAllocator(num_blocks=4, block_size_tokens=4)
    a.reserve(1, 12)
    assert not a.can_reserve(5) and a.can_reserve(4)
    with pytest.raises(KVCapacityError):
        a.reserve(2, 5)
    assert not a.fits_ever(17) and a.fits_ever(16)
    a.free(1)
    a.reserve(2, 16)


def test_blocks_are_reused_and_slots_follow_the_table():
    a = BlockAllocator(num_blocks=4, block_size_tokens=2)
    a.reserve(1, 4)
    a.append(1, 4)
    a.reserve(2, 2)
    t2 = a.append(2, 2)
    a.free(1)
    a.reserve(3, 4)
    t3 = a.append(3, 3)
    assert set(t3) <= {0, 1, 3} and t2 == [2]
    assert slot_mapping([5, 2], 0, 4, 2) == [10, 11, 4, 5]
    assert blocks_for_tokens(17, 16) == 2 and blocks_for_tokens(16, 16) == 1


def test_pool_write_gather_roundtrip():
    torch = pytest.importorskip("torch")
    from flexpipe_dag.runtime.kv_cache import PagedKVPool

    pool = PagedKVPool(num_layers=2, num_blocks=4, block_size_tokens=2, num_kv_heads=3, head_dim=5)
    k = torch.randn(3, 3, 5)
    v = torch.randn(3, 3, 5)
    slots = torch.tensor([6, 7, 2])
    pool.write(1, slots, k, v)
    gk, gv = pool.gather(1, slots)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert pool.gather(0, slots)[0].abs().sum() == 0
    assert pool.nbytes == 2 * 2 * 8 * 3 * 5 * 4


def test_paged_attention_matches_hf_forward():
    """Prefill in two chunks through scattered blocks, then decode: logits equal HF's full forward."""
    torch = pytest.importorskip("torch")
    from flexpipe_dag.runtime.model_loader import load_stage_module
    from flexpipe_dag.runtime.scheduler import MicroBatch, ScheduledSeq
    from flexpipe_dag.runtime.stage import batch_input_ids
    from tests.test_runtime_helpers import checkpoint, hf_model, prompt_ids

    ck = checkpoint()
    stage = load_stage_module(ck, 0, 30, first=True, last=True)
    pool = stage.new_kv_pool(num_blocks=16, block_size_tokens=4)
    ids = list(prompt_ids()[0])
    table = [9, 3, 14, 0, 7, 11, 2, 5, 12, 1][: blocks_for_tokens(len(ids) + 1, 4)]  # deliberately scattered
    cut = len(ids) // 2
    steps = [(ids[:cut], 0), (ids[cut:], cut)]
    with torch.inference_mode():
        ref = hf_model()(torch.tensor([ids])).logits[0]
        for toks, start in steps:
            mb = MicroBatch(0, [ScheduledSeq(0, toks, start, table, 0)])
            got = stage(mb, batch_input_ids(mb), pool)
            torch.testing.assert_close(got[0], ref[start + len(toks) - 1], rtol=1e-4, atol=1e-4)
        nxt = int(ref[-1].argmax())
        mb = MicroBatch(1, [ScheduledSeq(0, [nxt], len(ids), table, 1)])
        got = stage(mb, batch_input_ids(mb), pool)
        ref2 = hf_model()(torch.tensor([ids + [nxt]])).logits[0, -1]
    torch.testing.assert_close(got[0], ref2, rtol=1e-4, atol=1e-4)
    assert int(got[0].argmax()) == int(ref2.argmax())


def test_reset_resizes_an_empty_pool_and_refuses_one_in_use():
    a = BlockAllocator(num_blocks=4, block_size_tokens=4)
    a.reserve(1, 4)
    a.append(1, 4)
    with pytest.raises(ValueError, match="still hold KV blocks"):
        a.reset(8)
    a.free(1)
    a.reset(8, num_lanes=2)  # block size kept
    assert (a.num_blocks, a.block_size_tokens, a.num_lanes, a.blocks_per_lane) == (8, 4, 2, 4)
    a.reserve(2, 16, lane=1)
    assert a.append(2, 5) == [4, 5]  # lane 1 owns blocks 4..7
    a.free(2)
    with pytest.raises(ValueError, match="split evenly"):
        a.reset(6, num_lanes=4)
