"""The context rule: a request's prompt plus its output must fit the model's maximum context.

One rule for the simulator, the planner's workload statistics and the live runtime. A request of
``input_tokens + output_tokens`` above ``max_context_tokens`` (the model's
``max_position_embeddings`` / GGUF ``context_length``) is, by policy:

* ``"refuse"`` (the default): not served; the simulator records it as rejected with reason
  :data:`CONTEXT_REASON`, the planner leaves it out of its statistics, the runtime refuses it with a
  per-request error;
* ``"truncate"``: served with its prompt cut from the left (the most recent tokens kept, as vLLM's
  ``truncate_prompt_tokens``) to ``max_context_tokens - output_tokens``; when the output alone
  does not leave room for one prompt token, the prompt keeps its last token and the output is
  capped at ``max_context_tokens - 1`` (:func:`fit_to_context`).

Either way the count is reported (:class:`ContextReport`): nothing is dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.workload.request import Request, Workload

ContextPolicy = Literal["refuse", "truncate"]
#: The policies, default first.
CONTEXT_POLICIES: tuple[str, ...] = ("refuse", "truncate")
#: Reject reason of a request over the model's max context (the simulator's ``reject_reason``).
CONTEXT_REASON = "context"
#: Smallest usable max context: one prompt token and one output token.
MIN_CONTEXT_TOKENS = 2


def check_context_policy(policy: object, source: str | None = None, field: str | None = "context_policy") -> ContextPolicy:
    """``policy`` if it is one of :data:`CONTEXT_POLICIES`.

    Raises:
        InputError: naming ``source`` / ``field`` and the policies expected.
    """
    if policy not in CONTEXT_POLICIES:
        raise InputError(source, field, f"got {policy!r}; expected one of {list(CONTEXT_POLICIES)}")
    return policy  # type: ignore[return-value]


def check_max_context_tokens(value: object, source: str | None = None,
                             field: str | None = "max_context_tokens") -> int | None:
    """``value`` if it is ``None`` (no limit) or an integer >= :data:`MIN_CONTEXT_TOKENS` (tokens).

    Raises:
        InputError: naming ``source`` / ``field``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_CONTEXT_TOKENS:
        raise InputError(source, field, f"got {value!r}; expected None (no limit) or an integer >= "
                                        f"{MIN_CONTEXT_TOKENS} (prompt + output tokens)")
    return value


def over_context(input_tokens: int, output_tokens: int, max_context_tokens: int | None) -> bool:
    """True when ``input_tokens + output_tokens`` exceed ``max_context_tokens`` (``None``: never)."""
    return max_context_tokens is not None and input_tokens + output_tokens > max_context_tokens


def fit_to_context(input_tokens: int, output_tokens: int, max_context_tokens: int) -> tuple[int, int]:
    """``(input_tokens, output_tokens)`` after truncation to ``max_context_tokens`` (both >= 1).

    Unchanged when they fit. Otherwise the prompt keeps its last
    ``max(1, max_context_tokens - output_tokens)`` tokens and the output is capped at what is left.

    Raises:
        InputError: ``max_context_tokens`` below :data:`MIN_CONTEXT_TOKENS`.
    """
    check_max_context_tokens(max_context_tokens)
    if input_tokens + output_tokens <= max_context_tokens:
        return input_tokens, output_tokens
    keep = max(1, max_context_tokens - output_tokens)
    return keep, min(output_tokens, max_context_tokens - keep)


@dataclass(frozen=True)
class ContextReport:
    """What the context rule did to a set of requests (counts are requests; lengths in tokens).

    Attributes:
        max_context_tokens: the limit applied (``None``: no limit known, nothing checked).
        policy: ``"refuse"`` or ``"truncate"``.
        requests: requests checked.
        over_context: requests whose prompt + output exceeded the limit.
        refused: of those, refused (``policy == "refuse"``).
        truncated: of those, served truncated (``policy == "truncate"``).
        longest_tokens: the largest prompt + output seen (before truncation), 0 for no requests.
        refused_ids: ids of the refused requests (arrival order).
    """

    max_context_tokens: int | None
    policy: ContextPolicy
    requests: int
    over_context: int
    refused: int
    truncated: int
    longest_tokens: int
    refused_ids: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain form for JSON / metadata (without the ids)."""
        return {"max_context_tokens": self.max_context_tokens, "policy": self.policy, "requests": self.requests,
                "over_context": self.over_context, "refused": self.refused, "truncated": self.truncated,
                "longest_tokens": self.longest_tokens}

    def describe(self, model_name: str = "the model", truncate_hint: str = "truncate to serve them") -> str:
        """One line for users, e.g. ``"context: 12 of 500 requests over Llama-3-8B's 8192-token max
        context (prompt + output): refused (longest 9000 tokens; truncate to serve them)"``;
        ``truncate_hint`` says how (e.g. the flag that does it)."""
        if self.max_context_tokens is None:
            return f"context: {model_name}'s max context is not known; requests are not checked against it"
        head = (f"context: {self.over_context} of {self.requests} requests over {model_name}'s "
                f"{self.max_context_tokens}-token max context (prompt + output)")
        if not self.over_context:
            return head
        if self.policy == "refuse":
            return f"{head}: refused (longest {self.longest_tokens} tokens; {truncate_hint})"
        return f"{head}: served with the prompt truncated from the left"


@dataclass(frozen=True)
class ContextResult:
    """:func:`apply_context_rule`'s answer.

    Attributes:
        workload: the requests to serve (with ``"truncate"``: every request, the long ones cut; with
            ``"refuse"``: those within the limit), in the input's order.
        refused: the requests refused, in arrival order (empty with ``"truncate"``).
        truncated_ids: ids of the requests that were cut.
        report: the counts.
    """

    workload: Workload
    refused: tuple[Request, ...]
    truncated_ids: frozenset[str]
    report: ContextReport


def apply_context_rule(workload: Workload, max_context_tokens: int | None,
                       policy: ContextPolicy = "refuse") -> ContextResult:
    """Refuse or truncate the requests of ``workload`` over ``max_context_tokens`` (see the module doc).

    ``max_context_tokens`` ``None`` checks nothing (the workload comes back unchanged). The served
    workload keeps the input's name, source and meta, with ``meta["context"]`` = the report's dict.

    Raises:
        InputError: an unknown ``policy`` or a ``max_context_tokens`` below :data:`MIN_CONTEXT_TOKENS`.
    """
    policy = check_context_policy(policy, workload.source or workload.name)
    limit = check_max_context_tokens(max_context_tokens, workload.source or workload.name)
    reqs = workload.requests
    longest = max((r.input_tokens + r.output_tokens for r in reqs), default=0)
    if limit is None or longest <= limit:
        report = ContextReport(limit, policy, len(reqs), 0, 0, 0, longest)
        return ContextResult(workload, (), frozenset(), report)
    kept: list[Request] = []
    refused: list[Request] = []
    truncated: set[str] = set()
    for r in reqs:
        if not over_context(r.input_tokens, r.output_tokens, limit):
            kept.append(r)
        elif policy == "refuse":
            refused.append(r)
        else:
            inp, out = fit_to_context(r.input_tokens, r.output_tokens, limit)
            kept.append(replace(r, input_tokens=inp, output_tokens=out))
            truncated.add(r.request_id)
    over = len(refused) + len(truncated)
    report = ContextReport(limit, policy, len(reqs), over, len(refused), len(truncated), longest,
                           tuple(r.request_id for r in refused))
    served = Workload(workload.name, tuple(kept), workload.source, {**workload.meta, "context": report.to_dict()})
    return ContextResult(served, tuple(refused), frozenset(truncated), report)
