"""Stage compute in one process: chained stages reproduce transformers greedy generate exactly."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from flexpipe_dag.runtime.local import LocalPipeline
from flexpipe_dag.runtime.model_loader import load_stage_module, stage_param_bytes
from tests.test_runtime_helpers import checkpoint, hf_reference, requests


@pytest.mark.parametrize("ranges,micro_batch_size", [([(0, 30)], 8), ([(0, 4), (4, 30)], 1), ([(0, 2), (2, 25), (25, 30)], 8)])
def test_chained_stages_match_hf_generate(ranges, micro_batch_size):
    """In one process, no communication: a fast check of the stage code (the multi-process tests in
    test_runtime_pipeline.py cover every stage count, split and micro-batch size)."""
    pipe = LocalPipeline.from_layer_ranges(checkpoint(), ranges, num_blocks=128, block_size_tokens=16)
    reqs = requests() if micro_batch_size == 8 else requests()[:3]
    outs = pipe.generate(reqs, micro_batch_size=micro_batch_size)
    ref = hf_reference()
    assert {o.request_id: o.output_token_ids for o in outs} == {r.request_id: ref[r.request_id] for r in reqs}


def test_stage_holds_only_its_layers():
    ck = checkpoint()
    mid = load_stage_module(ck, 10, 20, first=False, last=False)
    assert mid.embed_tokens is None and mid.lm_head is None and len(mid.layers) == 10
    names = {n.split(".")[0] for n, _ in mid.named_parameters()}
    assert names == {"layers"}
    assert mid.param_bytes() == stage_param_bytes(ck, 10, 20, first=False, last=False)
    first = load_stage_module(ck, 0, 10, first=True, last=False)
    emb = ck.config.vocab_size * ck.config.hidden_size * 4
    assert first.param_bytes() == mid.param_bytes() + emb  # layers are the same size; plus the embedding


@pytest.mark.parametrize("ranges,budget", [([(0, 30)], 5), ([(0, 11), (11, 30)], 16)])
def test_chunked_prefill_matches_hf_generate(ranges, budget):
    """Prompts cut into chunks of the token budget (5: chunks that end mid KV block and share a
    micro-batch with decodes) give the same greedy tokens as whole-prompt prefill and transformers."""
    pipe = LocalPipeline.from_layer_ranges(checkpoint(), ranges, num_blocks=128, block_size_tokens=16)
    reqs = requests()
    assert max(len(r.prompt_token_ids) for r in reqs) > budget  # every prompt of more than `budget` tokens is cut
    outs = pipe.generate(reqs, micro_batch_size=4, max_tokens_per_micro_batch=budget, chunked_prefill=True)
    ref = hf_reference()
    assert {o.request_id: o.output_token_ids for o in outs} == {r.request_id: ref[r.request_id] for r in reqs}
    assert all(o.first_token_s >= o.arrival_s for o in outs)
