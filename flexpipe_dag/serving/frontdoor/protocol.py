"""The OpenAI API's request bodies and error shape, as FlexPipe's front door accepts them.

The fields follow OpenAI's API reference for ``POST /v1/completions`` and ``POST /v1/chat/completions``
(https://platform.openai.com/docs/api-reference). Fields FlexPipe does not implement (``n`` > 1,
``logprobs``, ``best_of``, ``tools``, ...) are refused by name with a 400, never ignored silently;
unknown fields are ignored as OpenAI does. ``priority`` (``"online"`` / ``"offline"``) is FlexPipe's
extension (the SDK sends it with ``extra_body``; the ``X-FlexPipe-Priority`` header does the same).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from flexpipe_dag.core.text import LONE_SURROGATE_PROBLEM
from flexpipe_dag.core.text import lone_surrogate_path as lone_surrogate_path  # re-exported: the front door's check

#: Most stop sequences one request may give (OpenAI's limit).
MAX_STOP_SEQUENCES = 4
#: ``max_tokens`` of a completion that gives none (OpenAI's default for ``/v1/completions``).
DEFAULT_COMPLETION_MAX_TOKENS = 16

PriorityClass = Literal["online", "offline"]


#: What pydantic puts in an error's location for the branch of a union (``str``, ``list[int]``, ...).
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|dict|list|none|.*\[.*\])$", re.IGNORECASE)


def field_path(loc) -> str | None:
    """The request field an error is about, as a client wrote it: ``messages.0.content``, without
    ``body`` and without pydantic's names of union branches (``prompt.str`` is ``prompt``); a query or path
    parameter by its name (``limit``, not ``query.limit``)."""
    if loc and loc[0] in ("query", "path"):
        loc = loc[1:]
    parts = [str(p) for p in loc if p != "body" and not _UNION_BRANCH.match(str(p))]
    return ".".join(parts) or None


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: the HTTP status (400 bad request, 401 no or wrong key, 404 unknown model, 429 queue
            full, 503 draining or not ready).
        message: what was wrong and what was expected.
        type: OpenAI's error type (``invalid_request_error``, ``authentication_error``, ...).
        param: the request field at fault, if one is.
        code: a machine-readable code (``context_length_exceeded``, ``model_not_found``, ...).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def refuse_lone_surrogates(value: Any, where: str = "", param: str | None = None) -> None:
    """Refuse ``value`` (a parsed JSON body or line) when it holds no Unicode text somewhere.

    Args:
        value: the parsed JSON.
        where: what the message names before the field (``"file F line 3: "``).
        param: the error's ``param`` (default: the field itself).

    Raises:
        APIError: 400 naming the field that holds a lone surrogate (see :func:`lone_surrogate_path`).
    """
    found = lone_surrogate_path(value)
    if found is not None:
        raise APIError(400, f"{where}{found or 'the body'}: {LONE_SURROGATE_PROBLEM}", param=param or found or None)


class _Body(BaseModel):
    """A request body: extra fields ignored (as OpenAI and vLLM do), lone surrogates refused by field."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        refuse_lone_surrogates(data)  # an APIError passes through pydantic to the app's handler
        return data


class _Sampling(_Body):
    """Fields both endpoints share. Numbers and flags are strict, as OpenAI's are: ``"2"`` or ``true``
    for ``max_tokens``, or ``"yes"`` for ``stream``, is a 400, not coerced."""

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: dict[str, StrictBool] | None = None
    n: StrictInt = 1
    user: str | None = None
    priority: PriorityClass | None = None
    # accepted by OpenAI, not implemented here: refused by name when set (see unsupported())
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("a stop sequence may not be empty")
        return stops

    @property
    def stop_sequences(self) -> list[str]:
        """The stop sequences, as a list (the validator has made ``stop`` one)."""
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options: {"include_usage": true}``)."""
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def unsupported(self) -> tuple[str, str] | None:
        """``(field, why)`` of the first field set to something FlexPipe does not do, else None."""
        if self.n != 1:
            return "n", f"only n=1 is served, got {self.n}"
        for name in ("logprobs", "top_logprobs", "logit_bias"):
            if getattr(self, name) not in (None, False, 0, {}):
                return name, f"{name} is not supported by FlexPipe"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return name, f"{name} is not supported by FlexPipe (0 or unset)"
        return None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text, or token ids, or a list of one of either (n=1)."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported by FlexPipe"
        if self.suffix:
            return "suffix", "suffix is not supported by FlexPipe"
        if self.best_of not in (None, 1):
            return "best_of", f"only best_of=1 is served, got {self.best_of}"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request.

        Raises:
            APIError: a batch of several prompts (one request serves one), or an empty prompt.
        """
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request, got a list of {len(prompt)} (send them as separate "
                                    "requests, or as a batch through /v1/batches)", param="prompt")
            prompt = prompt[0]  # type: ignore[assignment]
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        return prompt  # type: ignore[return-value]


class ChatMessage(BaseModel):
    """One chat message; ``content`` is text or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        """Only an assistant message may come without content (OpenAI's schema: its content is optional when it
        made tool calls); a system, developer or user message with none is refused, not served as empty text."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs its content (a string or a list of text parts), got none")
        return self

    def text(self) -> str:
        """The message's text.

        Raises:
            APIError: a part that is not text (images, audio: this model reads text only).
        """
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"only text content parts are served, got type {part.get('type')!r}",
                               param="messages")
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"a text content part needs its text as a string, got {part.get('text')!r:.80}",
                               param="messages")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is the newer name of ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools is not None:  # an empty list too: OpenAI refuses one ("expected an array with minimum length 1")
            return "tools", "tool calls are not supported by FlexPipe"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "only response_format type 'text' is served"
        return super().unsupported()

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``, else None (up to the context)."""
        return self.max_completion_tokens or self.max_tokens


#: OpenAI's bounds on a file's ``expires_after.seconds`` and a batch's ``output_expires_after.seconds`` (1 hour to
#: 30 days), and its default for a batch file (30 days).
MIN_FILE_EXPIRY_S = 3600
MAX_FILE_EXPIRY_S = 30 * 86400
DEFAULT_BATCH_FILE_EXPIRY_S = MAX_FILE_EXPIRY_S


class ExpiresAfter(_Body):
    """OpenAI's expiration policy: ``seconds`` after ``anchor`` (the file's creation; for a batch's output and error
    files, when the batch ended and they were written)."""

    anchor: Literal["created_at"]
    seconds: StrictInt = Field(ge=MIN_FILE_EXPIRY_S, le=MAX_FILE_EXPIRY_S)


class BatchCreateRequest(_Body):
    """``POST /v1/batches``."""

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: str = "24h"
    #: OpenAI's limits on ``metadata``: at most 16 pairs, keys of at most 64 characters, values of at most 512
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16)
    #: when the batch's output and error files expire (then a prune deletes its result rows); default 30 days
    output_expires_after: ExpiresAfter | None = None
