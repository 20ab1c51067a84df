"""Next-token sampling on the last stage: greedy, or seeded temperature / top-k / top-p sampling.

A seeded draw depends only on the request's seed and the index of the output token
(``torch.Generator`` seeded with ``seed * 1_000_003 + output_index``), never on which other
sequences share the micro-batch, so results are reproducible across batch sizes and gears.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flexpipe_dag.runtime.scheduler import ScheduledSeq

_SEED_STRIDE = 1_000_003
#: Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): dividing float32 logits by less
#: overflows them to infinity, and the draw would be argmax anyway.
SAMPLING_EPS = 1e-5
#: ``torch.Generator.manual_seed`` takes a signed 64-bit seed: the derived seed is taken modulo this.
_SEED_MODULUS = 2**63


def sample_tokens(logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> list[int]:
    """One token per row of ``logits`` (``[num_seqs, vocab]``) following each sequence's sampling params.

    ``temperature`` below :data:`SAMPLING_EPS` is greedy (argmax, first index on ties, as
    ``torch.argmax``/HF ``generate``). Otherwise logits / temperature, then top-k (``top_k > 0``), then
    top-p (``top_p < 1``: the smallest set of tokens whose probability reaches ``top_p``, never fewer
    than the most likely one), then a draw from a generator seeded as above (the seed taken modulo
    2**63; unseeded requests draw from torch's global generator). A row whose probabilities are not
    finite (NaN logits from a broken stage) falls back to argmax rather than failing the step.
    """
    out: list[int] = []
    for row, s in zip(logits.float(), seqs):
        if s.temperature < SAMPLING_EPS:
            out.append(int(torch.argmax(row)))
            continue
        row = row / s.temperature
        if s.top_k > 0:
            kth = torch.topk(row, min(s.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if s.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, dim=-1) >= s.top_p  # keep up to and incl. the crossing token
            drop[0] = False  # the most likely token always stays (a top_p that rounds to 0 in float32)
            row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            out.append(int(torch.argmax(torch.nan_to_num(row, nan=float("-inf")))))
            continue
        gen = None
        if s.seed is not None:
            gen = torch.Generator(device=probs.device).manual_seed((s.seed * _SEED_STRIDE + s.output_index)
                                                                   % _SEED_MODULUS)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
