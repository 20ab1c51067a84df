"""Prefill-only scoring jobs, the pure part: rows -> scoring units -> padded batches -> result records.

A scoring job asks, per row, for the log-probability of the prompt itself (every token after the
first, given what precedes it) or, when the row has ``continuations``, of each continuation given
the prompt (classification / multiple choice: ``choice`` is the continuation with the highest
total log-probability, as lm-evaluation-harness scores multiple-choice tasks).

One *unit* is one token sequence to run forward: the prompt alone, or prompt + one continuation.
Units are sorted by length and packed into micro-batches of equal padded length (right padding:
with causal attention it changes no real position), and several micro-batches of one length form
one pipeline batch so the stages overlap. No torch here; the DeepSpeed ranks live in
:mod:`~flexpipe_dag.runtime.score_runtime`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: Padded lengths are rounded up to a multiple of this, so few distinct shapes cross the pipeline.
PAD_MULTIPLE_TOKENS = 8
#: A micro-batch slot that holds no unit (padding rows of the last micro-batch of a length).
FILLER = -1


@dataclass(frozen=True)
class ScoreUnit:
    """One sequence to score: ``token_ids[score_from:]`` are scored (``score_from >= 1``).

    ``choice`` is the continuation's index within its row, or ``None`` for a prompt-only row.
    """

    row_id: str
    token_ids: tuple[int, ...]
    score_from: int
    choice: int | None = None

    @property
    def num_scored_tokens(self) -> int:
        return len(self.token_ids) - self.score_from


@dataclass
class ScoreBatch:
    """Micro-batches of one padded length ``length_tokens``; each slot a unit index or :data:`FILLER`."""

    length_tokens: int
    micro_batches: list[list[int]]


def gear_parts(layer_ranges: list[tuple[int, int]]) -> list[int]:
    """DeepSpeed ``PipelineModule`` partition boundaries for a gear's decoder-layer ranges.

    The pipeline's layer list is ``[embedding, decoder 0 .. L-1, norm + head]``
    (:mod:`~flexpipe_dag.runtime.pipe_layers`), so ``[(0, 4), (4, 30)]`` -> ``[0, 5, 32]``: stage 0
    owns the embedding and layers 0-3, stage 1 layers 4-29 and the head. Length ``num_stages + 1``.
    """
    n_layers = layer_ranges[-1][1]
    return [0] + [b + 1 for _, b in layer_ranges[:-1]] + [n_layers + 2]


def build_units(row_id: str, prompt_ids: list[int], continuation_ids: list[list[int]] | None) -> list[ScoreUnit]:
    """The units of one row.

    Raises:
        ValueError: nothing to score (a one-token prompt without continuations, an empty prompt,
            or an empty continuation).
    """
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    if not continuation_ids:
        if len(prompt_ids) < 2:
            raise ValueError("a one-token prompt has no next token to score; give 'continuations'")
        return [ScoreUnit(row_id, tuple(prompt_ids), 1)]
    units = []
    for i, cont in enumerate(continuation_ids):
        if not cont:
            raise ValueError(f"continuation {i} has no tokens")
        units.append(ScoreUnit(row_id, tuple(prompt_ids) + tuple(cont), len(prompt_ids), i))
    return units


def plan_score_batches(units: list[ScoreUnit], micro_batch_size: int, max_micro_batches: int,
                       pad_multiple: int = PAD_MULTIPLE_TOKENS) -> list[ScoreBatch]:
    """Pack units into pipeline batches: longest first, equal padded length within a batch.

    Deterministic (every rank computes the same plan from the same units). Slots past the last
    unit of a length are :data:`FILLER`, so every micro-batch of a batch has ``micro_batch_size`` rows.

    Args:
        micro_batch_size: rows per micro-batch (>= 1).
        max_micro_batches: micro-batches per pipeline batch (>= 1); more overlap, more memory.
    """
    if micro_batch_size < 1 or max_micro_batches < 1:
        raise ValueError("micro_batch_size and max_micro_batches must be >= 1")
    order = sorted(range(len(units)), key=lambda i: (-len(units[i].token_ids), i))
    by_length: dict[int, list[int]] = {}
    for i in order:
        padded = -(-len(units[i].token_ids) // pad_multiple) * pad_multiple
        by_length.setdefault(padded, []).append(i)
    batches = []
    per_batch = micro_batch_size * max_micro_batches
    for length, idx in by_length.items():
        for start in range(0, len(idx), per_batch):
            chunk = idx[start:start + per_batch]
            chunk += [FILLER] * (-len(chunk) % micro_batch_size)
            batches.append(ScoreBatch(length, [chunk[j:j + micro_batch_size]
                                               for j in range(0, len(chunk), micro_batch_size)]))
    return batches


def padded_rows(batch: ScoreBatch, units: list[ScoreUnit], pad_token_id: int) -> list[list[list[int]]]:
    """Token ids of each micro-batch, ``[micro_batches][micro_batch_size][length_tokens]``, right-padded."""
    out = []
    for mb in batch.micro_batches:
        rows = []
        for u in mb:
            ids = list(units[u].token_ids) if u != FILLER else []
            rows.append(ids + [pad_token_id] * (batch.length_tokens - len(ids)))
        out.append(rows)
    return out


def unit_logprobs(unit: ScoreUnit, next_token_logprobs_row: list[float]) -> list[float]:
    """The unit's scored tokens' log-probs from one row of ``next_token_logprobs`` (``[length - 1]``)."""
    return list(next_token_logprobs_row[unit.score_from - 1:len(unit.token_ids) - 1])


@dataclass
class RowScores:
    """Collects a row's unit results until all have arrived."""

    row_id: str
    prompt_tokens: int
    expected: int
    got: dict[int | None, list[float]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.got) == self.expected


def score_record(row: RowScores, gear_id: str, keep_token_logprobs: bool = True) -> dict[str, Any]:
    """The stored form of a scored row (log-probs in nats, natural log).

    Prompt-only: ``logprob`` (sum), ``mean_logprob``, ``scored_tokens``. With continuations:
    ``continuations`` (one ``{"tokens", "logprob", "mean_logprob"}`` each, in the row's order)
    and ``choice`` (index of the highest ``logprob``).
    """
    rec: dict[str, Any] = {"id": row.row_id, "gear_id": gear_id, "prompt_tokens": row.prompt_tokens}
    if None in row.got:
        lp = row.got[None]
        rec.update(scored_tokens=len(lp), logprob=math.fsum(lp), mean_logprob=math.fsum(lp) / len(lp))
        if keep_token_logprobs:
            rec["token_logprobs"] = lp
        return rec
    conts = []
    for i in range(row.expected):
        lp = row.got[i]
        c: dict[str, Any] = {"tokens": len(lp), "logprob": math.fsum(lp), "mean_logprob": math.fsum(lp) / len(lp)}
        if keep_token_logprobs:
            c["token_logprobs"] = lp
        conts.append(c)
    rec["continuations"] = conts
    rec["choice"] = max(range(len(conts)), key=lambda i: (conts[i]["logprob"], -i))
    return rec


class ScoreCollector:
    """Turns per-unit results into row records, written to ``sink`` the moment a row is complete.

    Args:
        units: the job's units (indices as in the batch plan).
        rows: row id -> :class:`RowScores` (what each row expects).
        sink: anything with ``write(record)`` (idempotent per ``record["id"]``).
    """

    def __init__(self, units: list[ScoreUnit], rows: dict[str, RowScores], sink, gear_id: str,
                 keep_token_logprobs: bool = True):
        self.units, self.rows, self.sink = units, rows, sink
        self.gear_id, self.keep_token_logprobs = gear_id, keep_token_logprobs
        self.finished = self.scored_tokens = self.forward_tokens = 0

    def add(self, scores: list[tuple[int, list[float]]]) -> list[str]:
        """Record ``(unit_index, token_logprobs)`` pairs; returns the ids of rows completed by them."""
        done = []
        for u, lps in scores:
            unit = self.units[u]
            row = self.rows[unit.row_id]
            row.got[unit.choice] = lps
            self.scored_tokens += len(lps)
            self.forward_tokens += len(unit.token_ids)
            if row.complete:
                self.sink.write(score_record(row, self.gear_id, self.keep_token_logprobs))
                self.finished += 1
                done.append(row.row_id)
        return done
