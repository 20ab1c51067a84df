"""The interface between the cost model (planner) and its users (simulator, controller).

The simulator replays requests through a gear using only these per-stage times, so any timing
source (the analytic cost model, a calibrated one, or measured tables) can drive it.
"""

from __future__ import annotations

from typing import Protocol


class StageTimingModel(Protocol):
    """Per-stage time estimates for one gear on one cluster, in milliseconds.

    All times are for **one replica** of a stage; a stage with ``r`` replicas can work on ``r``
    micro-batches at once.
    """

    num_stages: int

    def prefill_ms(self, stage_index: int, num_tokens: int, num_prompts: int = 1) -> float:
        """Time for the stage to run prefill over ``num_tokens`` prompt tokens, summed over the
        ``num_prompts`` prompts (or prompt chunks) of the micro-batch that share the step.

        The prompts matter where attention does (each attends within its own prompt: ``num_prompts``
        prompts of ``n`` tokens score ``num_prompts x n (n + 1) / 2`` query-key pairs, one prompt of
        all the tokens scores far more) and on the last stage (one logit row per prompt).
        """
        ...

    def decode_ms(self, stage_index: int, num_seqs: int, context_tokens: int) -> float:
        """Time for one decode step of ``num_seqs`` sequences whose KV contexts total ``context_tokens``.

        ``num_seqs`` is the sequences decoding in this step: the decoding members of one micro-batch,
        so at most the gear's ``micro_batch_size`` (the planner prices a full micro-batch).
        """
        ...

    def step_ms(self, stage_index: int, prefill_tokens: int, num_prompts: int, num_seqs: int,
                context_tokens: int) -> float:
        """Time of a mixed step: ``prefill_tokens`` of ``num_prompts`` prompts (or chunks) and one
        decode token for each of ``num_seqs`` sequences (``context_tokens`` KV tokens in total), in
        one pass over all the tokens as the runtime runs it (one weight read, one set of kernels),
        not a prefill followed by a decode."""
        ...

    def transfer_ms(self, stage_index: int, num_tokens: int) -> float:
        """Time to send the activations of ``num_tokens`` tokens from stage ``i`` to ``i + 1`` (0 after the last)."""
        ...
