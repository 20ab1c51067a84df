"""Batch jobs: a prompts file (or a trace) -> the pipeline -> a results sink, idempotently.

Prompts file: JSONL or Parquet with columns ``id`` (str, at most :data:`MAX_REQUEST_ID_CHARS`
characters), ``prompt`` (text) or ``token_ids`` (list of ints), ``max_new_tokens`` (int, optional: the
job's ``max_new_tokens``, which also caps a larger value), ``priority`` (int, optional:
:data:`~flexpipe_dag.runtime.scheduler.PRIORITY_OFFLINE`),
``continuations`` (optional, scoring jobs only: a list of strings or token-id lists, each scored given
the prompt). Integers are bounded by :data:`~flexpipe_dag.core.settings.INT32_MAX` (what the store's
integer columns and torch index tensors hold). Types are JSON's, strictly: an id is a string, a count or
token id an integer (``3.0``, ``"3"``, ``NaN`` and ``true`` are refused, naming the field); in Parquet an
integer id column is read as its decimal text, and an integer column with gaps (read as floats) as integers
with the gaps missing. A malformed row (bad JSON, missing, duplicate,
unprintable or over-long id, no prompt, a prompt over :data:`MAX_PROMPT_BYTES` bytes or
:data:`MAX_PROMPT_TOKENS` token ids, bad or out-of-range numbers) is counted and reported with its line
and reason, never fatal. The file itself must be a regular file of at most
:data:`~flexpipe_dag.core.user_files.MAX_PROMPTS_BYTES` bytes.

Sink protocol (:class:`ResultSink`): ``done_ids() -> set[str]`` and ``write(result: dict)``. Results are
written as each request finishes, keyed by request id; a re-run skips ids the sink already holds,
so a job killed half-way finishes only the missing requests. :class:`JsonlSink` is the file sink
(:mod:`flexpipe_dag.runtime.results_file`: it refuses a file that is not a results file, and cuts a
last line a crash tore at its first append: :func:`repair_torn_tail`); the SQL store implements the
same protocol.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from flexpipe_dag.core.errors import InputError, one_line, shown
from flexpipe_dag.core.ids import id_problem
from flexpipe_dag.core.settings import INT32_MAX
from flexpipe_dag.core.text import LONE_SURROGATE_PROBLEM, lone_surrogate_path
from flexpipe_dag.core.user_files import MAX_PROMPTS_BYTES, read_user_bytes, read_user_text
from flexpipe_dag.core.user_yaml import load_user_json
from flexpipe_dag.runtime.chat_template import prompt_token_ids
from flexpipe_dag.runtime.results_file import JsonlSink as JsonlSink  # re-exported: the file sink
from flexpipe_dag.runtime.results_file import repair_torn_tail as repair_torn_tail
from flexpipe_dag.runtime.scheduler import CONTEXT_REFUSAL, PRIORITY_OFFLINE, Request, RequestOutput
from flexpipe_dag.workload.files import read_user_frame
from flexpipe_dag.workload.loaders import token_column

_log = logging.getLogger(__name__)

#: Longest request id a prompts file may use (the store's ``request_results.request_key`` is 200 chars).
MAX_REQUEST_ID_CHARS = 200
#: Longest prompt text a row may hold, UTF-8 bytes (1 MiB, checked before tokenising: a tokenizer
#: makes at most one token per byte, and no served model's context comes near a million tokens).
MAX_PROMPT_BYTES = 1 << 20
#: Longest ``token_ids`` list a row may hold.
MAX_PROMPT_TOKENS = 1 << 20

#: The bundled public-domain text that trace-driven prompts are cut from.
CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "corpus" / "pride_and_prejudice_ch1.txt"


@dataclass
class PromptRow:
    """One valid row of a prompts file."""

    request_id: str
    prompt: str | None = None
    token_ids: list[int] | None = None
    max_new_tokens: int = 16
    priority: int = PRIORITY_OFFLINE
    continuations: list[str | list[int]] | None = None  # scoring jobs: score each given the prompt
    line: int = 0  # 1-based line (JSONL) or row number (Parquet, trace) it came from; 0: not from a file


@dataclass
class MalformedRow:
    """A row that was skipped: where it is and why."""

    line: int  # 1-based line (JSONL) or row number (Parquet)
    reason: str


@runtime_checkable
class ResultSink(Protocol):
    """Where finished requests go. Implementations must make ``write`` idempotent per ``result["id"]``."""

    def done_ids(self) -> set[str]: ...

    def write(self, result: dict[str, Any]) -> None: ...


def _bounded_int(value: Any, low: int) -> int:
    """``value``, an int in ``low..INT32_MAX``; TypeError (a float, a string, a boolean) / ValueError otherwise."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError("not an integer")
    if not low <= value <= INT32_MAX:
        raise ValueError
    return value


def _from_parquet(value: Any) -> Any:
    """A Parquet cell as JSON would give it: a missing value (NaN, ``pd.NA``, ``NaT``) is None, an integral float
    (an integer column with gaps reads as float64; a list column of doubles) an int, a numpy scalar or array
    its Python value or list, element by element."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_from_parquet(v) for v in value]
    if type(value).__name__ in ("NAType", "NaTType"):
        return None
    if isinstance(value, float) and (math.isnan(value) or (math.isfinite(value) and value == int(value))):
        return None if math.isnan(value) else int(value)
    return value


def _parse_row(raw: Any, where: int, max_new_tokens: int, seen: set[str]) -> PromptRow | MalformedRow:
    """One prompts row (JSON's types: Parquet cells go through :func:`_from_parquet` first) or why it is malformed."""
    if not isinstance(raw, dict):
        return MalformedRow(where, "expected a JSON object")
    rid = raw.get("id")
    if rid is None or (isinstance(rid, str) and rid.strip() == ""):
        return MalformedRow(where, "missing field 'id'")
    if not isinstance(rid, str):
        return MalformedRow(where, f"field 'id': expected a string, got {_short(rid)}")
    if len(rid) > MAX_REQUEST_ID_CHARS:
        return MalformedRow(where, f"field 'id': {len(rid)} characters; expected at most {MAX_REQUEST_ID_CHARS}")
    problem = id_problem(rid, MAX_REQUEST_ID_CHARS)
    if problem:
        return MalformedRow(where, f"field 'id': {problem}")
    if rid in seen:
        return MalformedRow(where, f"duplicate id {shown(rid)}")
    prompt, token_ids = raw.get("prompt"), raw.get("token_ids")
    if prompt is not None and token_ids is not None:
        return MalformedRow(where, "both 'prompt' and 'token_ids'; expected one of them")
    if isinstance(prompt, str) and (len(prompt) > MAX_PROMPT_BYTES
                                    or len(prompt.encode("utf-8", "surrogatepass")) > MAX_PROMPT_BYTES):
        return MalformedRow(where, f"field 'prompt': {len(prompt)} characters; expected at most {MAX_PROMPT_BYTES} "
                                   "bytes of UTF-8 (checked before tokenising)")
    if lone_surrogate_path(prompt) is not None:  # the tokenizer cannot read it (the front door refuses it too)
        return MalformedRow(where, f"field 'prompt': {LONE_SURROGATE_PROBLEM}")
    if isinstance(token_ids, list) and len(token_ids) > MAX_PROMPT_TOKENS:
        return MalformedRow(where, f"field 'token_ids': {len(token_ids)} ids; expected at most {MAX_PROMPT_TOKENS}")
    if token_ids is not None:
        try:
            if isinstance(token_ids, str):
                raise TypeError("a string, not a list")
            token_ids = [_bounded_int(t, 0) for t in token_ids]
        except (TypeError, ValueError, OverflowError):
            return MalformedRow(where, f"field 'token_ids': expected a list of integers 0..{INT32_MAX}")
        if not token_ids:
            return MalformedRow(where, "field 'token_ids': expected a non-empty list of non-negative integers")
    else:
        token_ids = None
    if token_ids is None:
        if not isinstance(prompt, str) or not prompt:
            return MalformedRow(where, "expected a non-empty 'prompt' string or a 'token_ids' list")
    mnt = raw.get("max_new_tokens", max_new_tokens)
    prio = raw.get("priority", PRIORITY_OFFLINE)
    try:
        mnt = max_new_tokens if mnt is None else mnt
        mnt = min(_bounded_int(mnt, 1), max_new_tokens)  # the job's figure is the default and the cap
    except (TypeError, ValueError, OverflowError):
        return MalformedRow(where, f"field 'max_new_tokens': expected an integer 1..{INT32_MAX}, "
                                   f"got {_short(raw.get('max_new_tokens'))}")
    try:
        prio = PRIORITY_OFFLINE if prio is None else prio
        prio = _bounded_int(prio, 0)
    except (TypeError, ValueError, OverflowError):
        return MalformedRow(where, f"field 'priority': expected an integer 0..{INT32_MAX}, "
                                   f"got {_short(raw.get('priority'))}")
    conts = raw.get("continuations")
    if conts is not None:
        ok = isinstance(conts, list) and conts and all(
            (isinstance(c, str) and c) or (isinstance(c, list) and c and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in c))
            for c in conts)
        if not ok:
            return MalformedRow(where, "field 'continuations': expected a non-empty list of non-empty strings "
                                       f"or lists of token ids 0..{INT32_MAX}")
        found = lone_surrogate_path(conts)
        if found is not None:
            return MalformedRow(where, f"field 'continuations.{found}': {LONE_SURROGATE_PROBLEM}")
        conts = list(conts)
    seen.add(rid)
    return PromptRow(rid, prompt if token_ids is None else None, token_ids, mnt, prio, conts, line=where)


def _short(value: Any) -> str:
    """``repr(value)`` cut to 40 characters for a message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_prompts(path: str | os.PathLike, max_new_tokens: int = 16) -> tuple[list[PromptRow], list[MalformedRow]]:
    """Read a JSONL (``.jsonl`` / ``.json``) or Parquet (``.parquet``) prompts file.

    Args:
        path: the prompts file.
        max_new_tokens: new tokens per request, default and cap: a row without ``max_new_tokens``
            gets it, a row asking for more is cut to it (``flexpipe run --max-new-tokens``, the
            ``batch_inference`` job's ``max_new_tokens``).

    Returns:
        ``(rows, malformed)``.

    Raises:
        InputError: the file is missing, not a regular file, over
            :data:`~flexpipe_dag.core.user_files.MAX_PROMPTS_BYTES`, not UTF-8, has another extension, or
            Parquet lacks an ``id`` column.
    """
    p = Path(path)
    if not p.exists():
        raise InputError(str(p), None, "prompts file not found")
    seen: set[str] = set()
    rows: list[PromptRow] = []
    bad: list[MalformedRow] = []
    if p.suffix in (".jsonl", ".json", ".ndjson"):
        text = read_user_text(p, MAX_PROMPTS_BYTES, what="prompts file (JSON lines)")
        # "\n" only: str.splitlines() also splits at U+2028 / U+2029 / U+0085, legal inside a JSON string
        for i, line in enumerate(text.split("\n"), start=1):
            line = line.removesuffix("\r")
            if not line.strip():
                continue
            try:
                raw = load_user_json(line, str(p), constants=True)  # _parse_row names a non-finite field
            except InputError as exc:
                bad.append(MalformedRow(i, f"invalid JSON: {exc.problem.removeprefix('not valid JSON: ')}"))
                continue
            r = _parse_row(raw, i, max_new_tokens, seen)
            if isinstance(r, PromptRow):
                rows.append(r)
            else:
                bad.append(r)
    elif p.suffix == ".parquet":
        import pandas as pd

        read_user_bytes(p, MAX_PROMPTS_BYTES, what="prompts file (Parquet)", head_bytes=4)  # a regular file, capped
        try:
            df = pd.read_parquet(p)
        except (OSError, ValueError, MemoryError) as exc:
            raise InputError(str(p), None, f"cannot read as Parquet: {one_line(str(exc), 200)}") from None
        if "id" not in df.columns:
            raise InputError(str(p), "id", f"expected an 'id' column, found {list(df.columns)}")
        for i, raw in enumerate(df.to_dict(orient="records"), start=1):
            raw = {key: _from_parquet(value) for key, value in raw.items()}
            if isinstance(raw.get("id"), int) and not isinstance(raw["id"], bool):
                raw["id"] = str(raw["id"])  # an integer id column: its decimal text
            r = _parse_row(raw, i, max_new_tokens, seen)
            if isinstance(r, PromptRow):
                rows.append(r)
            else:
                bad.append(r)
    else:
        raise InputError(str(p), None, f"expected a .jsonl or .parquet prompts file, got {p.suffix!r}")
    return rows, bad


def prompts_from_trace(trace_csv: str | os.PathLike, tokenizer, *, num_requests: int, max_prompt_tokens: int,
                       max_new_tokens: int, corpus_path: str | os.PathLike = CORPUS_PATH,
                       priority: int = PRIORITY_OFFLINE, length_scale: float = 1.0) -> list[PromptRow]:
    """Rows whose prompt / output lengths follow an Azure LLM trace (``ContextTokens``, ``GeneratedTokens``).

    Prompt token ids are consecutive windows of the bundled corpus (tokenised once), each cut to
    ``min(ceil(ContextTokens * length_scale), max_prompt_tokens)`` tokens; ``max_new_tokens`` is
    ``min(ceil(GeneratedTokens * length_scale), max_new_tokens)`` (at least 1 each). A
    ``length_scale`` below 1 keeps the trace's length distribution at a fraction of its cost, where a
    bare cap would make most conversation prompts exactly ``max_prompt_tokens`` long. The first
    ``num_requests`` trace rows are used.

    Raises:
        InputError: the trace lacks the columns or has fewer rows than asked, or one of the rows used has a
            token count that is not an integer in ``1..INT32_MAX`` (named by row and column, as the trace
            loaders name it).
    """
    df = read_user_frame(Path(trace_csv), "Azure LLM trace (CSV)", comment="#")
    for col in ("ContextTokens", "GeneratedTokens"):
        if col not in df.columns:
            raise InputError(str(trace_csv), col, f"expected an Azure LLM trace column {col!r}")
    if len(df) < num_requests:
        raise InputError(str(trace_csv), None, f"has {len(df)} rows, {num_requests} requested")
    corpus = tokenizer(Path(corpus_path).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    rows: list[PromptRow] = []
    offset = 0
    head = df.head(num_requests)
    # checked before int(): 'abc' or an empty cell is an InputError, not a ValueError; -5 is not silently 1
    contexts: list[int] = token_column(head, "ContextTokens", str(trace_csv)).tolist()
    generated: list[int] = token_column(head, "GeneratedTokens", str(trace_csv)).tolist()
    for i, (context_tokens, generated_tokens) in enumerate(zip(contexts, generated)):
        n = max(1, min(math.ceil(int(context_tokens) * length_scale), max_prompt_tokens, len(corpus)))
        if offset + n > len(corpus):
            offset = 0
        rows.append(PromptRow(f"trace-{i:05d}", None, corpus[offset:offset + n],
                              max(1, min(math.ceil(int(generated_tokens) * length_scale), max_new_tokens)),
                              priority, line=i + 1))
        offset += n
    return rows


def result_record(out: RequestOutput, gear_id: str, tokenizer=None) -> dict[str, Any]:
    """The stored form of one finished request (times in ms)."""
    rec: dict[str, Any] = {"id": out.request_id, "gear_id": gear_id, "output_token_ids": out.output_token_ids,
                           "finish_reason": out.finish_reason, "prompt_tokens": len(out.prompt_token_ids),
                           "output_tokens": len(out.output_token_ids), "ttft_ms": out.ttft_s * 1000.0,
                           "tpot_ms": None if out.tpot_s is None else out.tpot_s * 1000.0,
                           "e2e_ms": out.e2e_s * 1000.0}
    if tokenizer is not None:
        rec["output_text"] = tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
    return rec


@dataclass
class BatchReport:
    """What a batch job did. ``failure`` is the StageFailedError message when the run broke off.

    ``refused``: request id -> why it was not served (larger than the KV pool, or prompt +
    ``max_new_tokens`` over the model's max context); ``truncated``: request id -> how it was cut to
    the max context (``RuntimeOptions.truncate_context``); ``no_text``: ids of finished requests whose
    output decodes to no text (only end-of-sequence / special tokens or whitespace), in finishing order.
    """

    rows: int
    malformed: list[MalformedRow]
    skipped_done: int
    submitted: int
    finished: int
    refused: dict[str, str] = field(default_factory=dict)
    output_tokens: int = 0
    elapsed_s: float = 0.0
    failure: str | None = None
    stage_info: list[dict] = field(default_factory=list)
    truncated: dict[str, str] = field(default_factory=dict)
    no_text: list[str] = field(default_factory=list)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def refused_context(self) -> int:
        """Requests refused because prompt + ``max_new_tokens`` exceed the model's max context."""
        return sum(CONTEXT_REFUSAL in why for why in self.refused.values())

    @property
    def over_context(self) -> int:
        """Requests over the model's max context: refused or truncated."""
        return self.refused_context + len(self.truncated)


def out_of_vocabulary(rows: list[PromptRow], vocab_size: int) -> tuple[list[PromptRow], list[MalformedRow]]:
    """``(rows to run, rows refused)``: a ``token_ids`` row with an id outside ``0..vocab_size - 1`` is refused as a
    malformed row (as :func:`to_requests` would), before any worker starts, so a file of nothing else is refused
    whole rather than run to a summary of no results."""
    keep: list[PromptRow] = []
    refused: list[MalformedRow] = []
    for r in rows:
        why = _outside_vocabulary(r, r.token_ids or [], vocab_size)
        if why is not None:
            refused.append(why)
        else:
            keep.append(r)
    return keep, refused


def _outside_vocabulary(row: PromptRow, ids: list[int], vocab_size: int) -> MalformedRow | None:
    """The malformed row ``row`` is when one of its prompt ``ids`` lies outside ``0..vocab_size - 1``, else None."""
    if ids and max(ids) >= vocab_size:
        return MalformedRow(row.line, f"id {row.request_id!r}: field 'token_ids': id {max(ids)} is outside the "
                                      f"model's vocabulary (0..{vocab_size - 1})")
    return None


def to_requests(rows: list[PromptRow], tokenizer, eos_token_ids: tuple[int, ...],
                malformed: list[MalformedRow] | None = None, chat_template: bool = False) -> list[Request]:
    """Tokenise text prompts into :class:`Request` objects (``token_ids`` rows are taken as they are).

    Args:
        chat_template: wrap each plain-text prompt in the tokenizer's chat template
            (:func:`~flexpipe_dag.runtime.chat_template.prompt_token_ids`); decide it with
            :func:`~flexpipe_dag.runtime.chat_template.resolve_chat_template`.
    """
    reqs = []
    vocab_size = len(tokenizer) if tokenizer is not None else None
    for r in rows:
        ids = r.token_ids if r.token_ids is not None else prompt_token_ids(tokenizer, r.prompt or "", chat_template)
        if not ids:
            if malformed is not None:
                malformed.append(MalformedRow(r.line, f"id {r.request_id!r}: prompt tokenises to nothing"))
            continue
        outside = _outside_vocabulary(r, ids, vocab_size) if vocab_size is not None else None
        if outside is not None:
            if malformed is not None:
                malformed.append(outside)
            continue
        reqs.append(Request(r.request_id, list(ids), r.max_new_tokens, priority=r.priority, eos_token_ids=eos_token_ids))
    return reqs


def run_batch_job(runtime, rows: list[PromptRow], sink: ResultSink, *, malformed: list[MalformedRow] | None = None,
                  on_progress: Callable[[int, int], None] | None = None, on_metrics=None,
                  decode_text: bool = True, chat_template: bool = False) -> BatchReport:
    """Run the rows not yet in ``sink`` through a started :class:`~flexpipe_dag.runtime.pipeline.PipelineRuntime`.

    Each result is written to the sink the moment it finishes. On a stage failure the report's
    ``failure`` names the stage, and everything finished before it is already in the sink. Results
    whose output decodes to no text are listed in the report's ``no_text`` (see :func:`no_text_line`).

    Args:
        on_progress: called with ``(finished, submitted)`` after each result.
        decode_text: store each output's text (``output_text``) beside its token ids.
        chat_template: wrap plain-text prompts in the model's chat template (see :func:`to_requests`).
    """
    from flexpipe_dag.runtime.pipeline import StageFailedError

    malformed = list(malformed or [])
    done = sink.done_ids()
    todo = [r for r in rows if r.request_id not in done]
    tok = runtime.ckpt.tokenizer()
    reqs = to_requests(todo, tok, runtime.ckpt.eos_token_ids(), malformed, chat_template=chat_template)
    report = BatchReport(rows=len(rows), malformed=malformed, skipped_done=len(rows) - len(todo),
                         submitted=len(reqs), finished=0, stage_info=list(runtime.stage_info))

    def on_result(out: RequestOutput) -> None:
        record = result_record(out, runtime.gear.gear_id, tok)
        if not record["output_text"].strip():
            report.no_text.append(out.request_id)
        if not decode_text:
            del record["output_text"]
        sink.write(record)
        report.finished += 1
        report.output_tokens += len(out.output_token_ids)
        if on_progress:
            on_progress(report.finished, report.submitted)

    t0 = time.monotonic()
    try:
        runtime.generate(reqs, on_result=on_result, on_metrics=on_metrics)
        if on_metrics is not None and reqs:  # the last partial window (a job may be shorter than a period)
            runtime.flush_metrics(on_metrics)
    except StageFailedError as exc:
        report.failure = str(exc)
    report.elapsed_s = time.monotonic() - t0
    ids = {r.request_id for r in reqs}  # a runtime serving several jobs remembers the earlier ones' requests
    report.refused = {k: v for k, v in runtime.refused.items() if k in ids}
    report.truncated = {k: v for k, v in getattr(runtime, "truncated", {}).items() if k in ids}
    return report


def no_text_line(no_text: list[str], finished: int, eos_token_ids: tuple[int, ...] = (),
                 hint: str | None = None) -> str | None:
    """One warning line when finished requests produced no text, e.g. ``"3 of 4 rows produced no text
    (only end-of-sequence / special tokens or whitespace): a, b, c"``; None when every one has text.

    Args:
        no_text: ids of the results without text (:attr:`BatchReport.no_text`), the first 5 are named.
        finished: results finished in the same run.
        hint: what may fix it, appended after ``"; "``.
    """
    if not no_text:
        return None
    named = ", ".join(shown(i) for i in no_text[:5]) + (f" and {len(no_text) - 5} more" if len(no_text) > 5 else "")
    eos = f" (end-of-sequence ids {list(eos_token_ids)})" if eos_token_ids else ""
    return (f"{len(no_text)} of {finished} rows produced no text: their output is only end-of-sequence / special "
            f"tokens{eos} or whitespace: {named}" + (f"; {hint}" if hint else ""))
