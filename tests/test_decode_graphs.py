"""Decode steps at padded static shapes (the CUDA-graph path, run eagerly on CPU): bucket arithmetic,
greedy outputs unchanged against ``transformers`` and against the unpadded path, contexts crossing a
bucket, and the option's wiring through the multi-process runtime. The captured graphs themselves run
in ``tests/test_runtime_gpu.py`` (``gpu`` marker)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from flexpipe_dag.core.errors import InputError  # noqa: E402
from flexpipe_dag.runtime.decode_graphs import (  # noqa: E402
    DecodeGraphs,
    batch_bucket,
    context_bucket,
    graph_safe_rope,
    make_decode_graphs,
)
from flexpipe_dag.runtime.local import LocalPipeline  # noqa: E402
from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions  # noqa: E402
from flexpipe_dag.runtime.scheduler import Request  # noqa: E402
from tests.test_runtime_helpers import checkpoint, gear, hf_reference, prompt_ids, requests  # noqa: E402


def test_buckets_pad_up_to_the_next_captured_batch_and_a_power_of_two_context():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 200, 256)] == [1, 2, 4, 8, 8, 16, 256, 256]
    assert batch_bucket(257) is None
    assert [context_bucket(n, 4096) for n in (1, 256, 257, 1000, 4096)] == [256, 256, 512, 1024, 4096]
    assert context_bucket(300, 400) == 400  # capped at the pool's slots
    assert context_bucket(401, 400) is None


def test_modes_are_checked_and_capture_needs_a_cuda_pool():
    pipe = LocalPipeline.from_layer_ranges(checkpoint(), [(0, 2)], num_blocks=4, block_size_tokens=16,
                                           decode_graphs="off")
    stage, pool = pipe.stages[0], pipe.pools[0]
    assert pipe.graphs == [None]
    assert make_decode_graphs("auto", stage, pool) is None  # a CPU pool: no graphs
    assert isinstance(make_decode_graphs("eager", stage, pool), DecodeGraphs)
    with pytest.raises(ValueError, match="decode_graphs: expected one of auto, off, eager, got 'fast'"):
        make_decode_graphs("fast", stage, pool)
    with pytest.raises(ValueError, match="CUDA graphs need the KV pool on a CUDA device, not cpu"):
        DecodeGraphs(stage, pool, capture=True)
    with pytest.raises(InputError, match="decode_graphs: expected one of auto, off, eager, got 'fast'"):
        PipelineRuntime(gear([(0, 30)]), checkpoint(), RuntimeOptions(decode_graphs="fast"))
    # buckets pad at most to the pool's slots, or to the model's context where the pool holds more
    assert DecodeGraphs(stage, pool, capture=False).max_context_tokens == 64
    big = stage.new_kv_pool(1024, 16)
    assert DecodeGraphs(stage, big, capture=False).max_context_tokens == stage.config.max_position_embeddings == 8192
    # a dynamic RoPE cannot be captured (its update syncs with the CPU and swaps its buffer): no graphs
    assert graph_safe_rope(stage) and stage.rotary_emb.rope_type == "default"
    stage.rotary_emb.rope_type = "dynamic"
    assert not graph_safe_rope(stage)


@pytest.mark.parametrize("ranges,micro_batch_size", [([(0, 30)], 8), ([(0, 4), (4, 30)], 3)])
def test_padded_decode_steps_match_hf_generate(ranges, micro_batch_size):
    """8 prompts at micro-batch 8 (as requests finish, 5-7 sequences pad to 8) and at 3 (pads to 4)."""
    pipe = LocalPipeline.from_layer_ranges(checkpoint(), ranges, num_blocks=128, block_size_tokens=16,
                                           decode_graphs="eager")
    reqs = requests()
    outs = pipe.generate(reqs, micro_batch_size=micro_batch_size)
    ref = hf_reference()
    assert {o.request_id: o.output_token_ids for o in outs} == {r.request_id: ref[r.request_id] for r in reqs}
    for graphs in pipe.graphs:
        assert graphs is not None and graphs.eager_steps > 0
        assert max(s for s, _ in graphs.buckets) == batch_bucket(micro_batch_size)  # 3 sequences ran as 4


def test_contexts_crossing_a_bucket_decode_as_the_unpadded_path():
    """Prompts of 240-255 tokens decoding 30 tokens each cross from the 256-token bucket into the 512 one."""
    ids = [t for p in prompt_ids() for t in p]
    reqs = [Request(f"long{n}", ids[:n], 30) for n in (240, 245, 250, 255, 251)]  # no EOS: all 30 tokens
    ranges = [(0, 10), (10, 30)]
    padded = LocalPipeline.from_layer_ranges(checkpoint(), ranges, num_blocks=128, block_size_tokens=16,
                                             decode_graphs="eager")
    plain = LocalPipeline.from_layer_ranges(checkpoint(), ranges, num_blocks=128, block_size_tokens=16,
                                            decode_graphs="off")
    got = {o.request_id: o.output_token_ids for o in padded.generate(reqs, micro_batch_size=5)}
    want = {o.request_id: o.output_token_ids for o in plain.generate(reqs, micro_batch_size=5)}
    assert got == want and all(len(v) == 30 for v in got.values())
    graphs = padded.graphs[1]
    assert graphs is not None and {(8, 256), (8, 512)} <= set(graphs.buckets)


def test_the_runtime_option_reaches_the_stage_workers():
    """Two stage processes on the padded path (the option travels in the worker spec): outputs exact."""
    reqs = requests(prefix="dg-")
    with PipelineRuntime(gear([(0, 15), (15, 30)], micro_batch_size=8), checkpoint(),
                         RuntimeOptions(decode_graphs="eager")) as rt:
        outs = rt.generate(reqs)
    ref = hf_reference()
    assert {o.request_id: o.output_token_ids for o in outs} == {r.request_id: ref[r.request_id[3:]] for r in reqs}
