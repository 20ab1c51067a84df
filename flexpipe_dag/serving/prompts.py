"""Real prompts for trace-driven serving: token ids of the trace's lengths, cut from a bundled public-domain text.

A request of ``input_tokens`` gets the next ``min(input_tokens, max_prompt_tokens)`` tokens of the
corpus (wrapping around), and ``min(output_tokens, max_new_tokens)`` tokens to generate, so a CPU
host can serve the real arrival times and length *shape* of a production trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flexpipe_dag.runtime.batch import CORPUS_PATH
from flexpipe_dag.runtime.scheduler import PRIORITY_OFFLINE, Request
from flexpipe_dag.workload.request import Workload


@dataclass(frozen=True)
class TimedRequest:
    """A runtime request with its arrival time (seconds since the start of the replay) and class."""

    arrival_s: float
    request: Request
    klass: str


def corpus_token_ids(tokenizer, corpus_path: str | Path = CORPUS_PATH) -> list[int]:
    """The bundled corpus tokenised once (no special tokens)."""
    return tokenizer(Path(corpus_path).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]


def timed_requests(workload: Workload, tokenizer, eos_token_ids: tuple[int, ...], *, max_prompt_tokens: int,
                   max_new_tokens: int, corpus_path: str | Path = CORPUS_PATH) -> list[TimedRequest]:
    """Runtime requests following ``workload``'s arrivals and (capped) lengths; offline ones get offline priority."""
    corpus = corpus_token_ids(tokenizer, corpus_path)
    out, offset = [], 0
    for r in workload:
        n = max(1, min(r.input_tokens, max_prompt_tokens, len(corpus)))
        if offset + n > len(corpus):
            offset = 0
        out.append(TimedRequest(r.arrival_s, Request(
            r.request_id, corpus[offset:offset + n], max(1, min(r.output_tokens, max_new_tokens)),
            priority=0 if r.klass == "online" else PRIORITY_OFFLINE, eos_token_ids=eos_token_ids), r.klass))
        offset += n
    return out
