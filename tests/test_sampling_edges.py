"""Sampling never fails a pipeline step on extreme but valid parameters (found by the front-door attack:
one request with top_p 1e-300, temperature 1e-300 or seed 2**45 killed the stage)."""

from __future__ import annotations

import torch

from flexpipe_dag.runtime.sampling import sample_tokens
from flexpipe_dag.runtime.scheduler import ScheduledSeq


def _seq(**kw) -> ScheduledSeq:
    fields = {"seq_id": 0, "token_ids": [1], "start_pos": 0, "block_table": [0], "output_index": 0}
    fields.update(kw)
    return ScheduledSeq(**fields)


def test_extreme_sampling_values_give_a_token_never_an_error():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 5
    best = int(torch.argmax(logits[0]))
    assert sample_tokens(logits, [_seq(temperature=1e-300)]) == [best]  # below the eps: greedy
    assert sample_tokens(logits, [_seq(temperature=1.0, top_p=1e-300, seed=1)]) == [best]  # the top token stays
    for seed in (2**45, 2**62, -(2**63), 2**63 - 1):
        (tok,) = sample_tokens(logits, [_seq(temperature=0.7, seed=seed)])
        assert 0 <= tok < 50
    assert sample_tokens(logits, [_seq(temperature=1e-4, seed=3)]) == [best]  # tiny but valid: still sampled, peaked
    nan = torch.full((1, 50), float("nan"))
    nan[0, 7] = 3.0
    assert sample_tokens(nan, [_seq(temperature=1.0, seed=1)]) == [7]  # a broken row falls back to argmax


def test_a_seeded_draw_is_reproducible_and_independent_of_its_batch():
    logits = torch.randn(3, 50)
    seqs = [_seq(seq_id=i, temperature=0.9, seed=42, output_index=5) for i in range(3)]
    alone = [sample_tokens(logits[i:i + 1], [seqs[i]])[0] for i in range(3)]
    assert sample_tokens(logits, seqs) == alone
