"""Layers per stage for a known offline workload on identical stage workers: the split whose slowest stage
is fastest for *these* prompts.

An even split (``--stages N``) ignores that the stages do different work: the first embeds every token, the
last runs the final norm and the LM head, once per sampled token (one logit row per sequence per step), while
a decoder layer runs once per token, prompt tokens included. How much the head weighs against a layer
therefore depends on the workload: in a decode step of ``b`` sequences both read their weights once (the head
of SmolLM2-135M, 49,152 x 576, reads as much as 8 of its 30 layers), while in a prefill step of ``b`` prompts of
``n`` tokens each layer computes ``b n`` rows and the head ``b``. Measured on this 2-core host
(``bench/runtime_bench.py``, 64 Azure conv prompts of <= 64 tokens, 16 output tokens, micro-batch 8): prefill and
decode take about half the run each, and the split that balances the stages is neither the even one nor
the one that balances parameters.

:func:`workload_cost` prices the workload's micro-batch steps with the planner's cost model
(:class:`~flexpipe_dag.planner.cost_model.CostModel`: the same roofline and per-kernel overhead the planner
and the simulator use) as one layer's, the embedding's and the head's total time; :func:`workload_layer_counts`
then finds the exact min-bottleneck split
(:func:`~flexpipe_dag.planner.partition.min_bottleneck_split`) over stages of identical workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flexpipe_dag.planner.cost_model import CostModel
from flexpipe_dag.planner.partition import check_stage_count, min_bottleneck_split

#: Rows of the workload priced (the first ones): the split depends on the mix of prompt and output lengths,
#: which this many rows already show, and pricing is then bounded (about 50 ms) whatever the job's size.
MAX_PRICED_ROWS = 4096


@dataclass(frozen=True)
class WorkloadCost:
    """Time of one workload's steps on one worker, split by the pieces a stage may hold, ms.

    Attributes:
        layer_ms: one decoder layer over every step.
        first_ms: the embedding (first stage only) over every step.
        last_ms: the final norm + LM head (last stage only) over every step: one logit row per sequence per step.
        steps: micro-batch steps priced (prefill and decode).
    """

    layer_ms: float
    first_ms: float
    last_ms: float
    steps: int

    def stage_ms(self, num_layers: int, first: bool, last: bool) -> float:
        """A stage's time over the workload: ``num_layers`` layers plus the embedding / head it holds, ms."""
        return num_layers * self.layer_ms + (self.first_ms if first else 0.0) + (self.last_ms if last else 0.0)


def workload_cost(cost: CostModel, device_id: str, prompt_tokens: Sequence[int], output_tokens: Sequence[int],
                  micro_batch_size: int) -> WorkloadCost:
    """Price a workload's steps as the runtime schedules an offline job: the rows in order, in micro-batches
    of ``micro_batch_size``; each micro-batch prefills its prompts in one step (one logit row per prompt,
    which samples the first token), then decodes one token per sequence per step while any still runs, a
    sequence of ``k`` output tokens taking part in ``k - 1`` decode steps. Decode steps in which the same
    sequences run are priced at their middle step's context (attention reads grow linearly within them).

    Args:
        cost: the cost model of the model and dtype run (its cluster holds ``device_id``).
        device_id: the worker every stage runs on (identical workers).
        prompt_tokens, output_tokens: per row, prompt tokens and output tokens (>= 1 each); only the first
            :data:`MAX_PRICED_ROWS` rows are priced.
        micro_batch_size: sequences per micro-batch (>= 1).

    Raises:
        ValueError: the two lists differ in length or are empty, a length is < 1, or ``micro_batch_size`` < 1.
    """
    if len(prompt_tokens) != len(output_tokens) or not prompt_tokens:
        raise ValueError(f"expected as many output lengths as prompts (>= 1), got {len(prompt_tokens)} prompts and "
                         f"{len(output_tokens)} output lengths")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size: expected >= 1, got {micro_batch_size}")
    prompts = np.asarray(prompt_tokens[:MAX_PRICED_ROWS], dtype=np.int64)
    outputs = np.asarray(output_tokens[:MAX_PRICED_ROWS], dtype=np.int64)
    if prompts.min() < 1 or outputs.min() < 1:
        raise ValueError("every prompt and output length must be >= 1 token")
    layer = first = last = 0.0
    steps = 0
    for g in range(0, len(prompts), micro_batch_size):
        p, o = prompts[g:g + micro_batch_size], outputs[g:g + micro_batch_size]
        n = int(p.sum())
        pairs = float((p * (p + 1) // 2).sum())
        layer += cost.layer_step_ms(device_id, n, pairs, n)
        first += cost.first_extra_ms(device_id, n)
        last += cost.last_extra_ms(device_id, len(p))
        steps += 1
        done = 1  # decode steps 1 .. done - 1 priced so far; a sequence of k outputs decodes at steps 1 .. k - 1
        for k in np.unique(o):
            span = int(k) - done  # steps done .. k - 1: the sequences with more than k - 1 outputs, all running
            if span <= 0:
                continue
            running = o >= k
            seqs = int(running.sum())
            mid = done + (span - 1) / 2.0  # the middle step's index: each running sequence holds prompt + mid tokens
            context = int(round(float(p[running].sum()) + seqs * mid))
            layer += span * cost.layer_decode_ms(device_id, seqs, context)
            first += span * cost.first_extra_ms(device_id, seqs)
            last += span * cost.last_extra_ms(device_id, seqs)
            steps += span
            done = int(k)
    return WorkloadCost(layer, first, last, steps)


def workload_layer_counts(work: WorkloadCost, num_layers: int, num_stages: int,
                          replicas: Sequence[int] | None = None) -> list[int]:
    """Layers per stage minimising the slowest stage's time over the workload (every stage >= 1 layer; the
    first holds the embedding, the last the head), exactly (:func:`~flexpipe_dag.planner.partition.min_bottleneck_split`).
    A stage of ``replicas[s]`` workers counts ``1 / replicas[s]`` of its time (its sequences are shared over
    that many lanes); default one worker per stage.

    Raises:
        InfeasibleError: ``num_stages`` outside ``1..num_layers``.
        ValueError: ``replicas`` not one whole count >= 1 per stage, or a cost in ``work`` negative or not finite.
    """
    check_stage_count(num_layers, num_stages)
    reps = list(replicas) if replicas is not None else [1] * num_stages
    if len(reps) != num_stages or not all(isinstance(r, int | np.integer) and r >= 1 for r in reps):
        raise ValueError(f"replicas: expected {num_stages} whole counts >= 1, got {reps}")
    for name in ("layer_ms", "first_ms", "last_ms"):
        value = getattr(work, name)
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"WorkloadCost.{name}: expected a finite time >= 0 ms, got {value}")
    layers = np.arange(num_layers + 1, dtype=float)
    span = layers[None, :] - layers[:, None]  # [i, j]: layers in [i, j)
    costs = np.empty((num_stages, num_layers + 1, num_layers + 1))
    for s in range(num_stages):
        costs[s] = (span * work.layer_ms + (work.first_ms if s == 0 else 0.0)
                    + (work.last_ms if s == num_stages - 1 else 0.0)) / reps[s]
    _, sizes = min_bottleneck_split(costs)
    return sizes
