"""From an OpenAI request body to the :class:`Generation` the engine serves: the prompt tokenised (a
chat in the model's template), token ids checked against the vocabulary, ``max_tokens`` checked
against the context. The HTTP endpoints and the Batch API runner share it, so a batch line is served
exactly as the same body sent to the endpoint."""

from __future__ import annotations

from flexpipe_dag.serving.frontdoor.engine import FrontDoorEngine, Generation
from flexpipe_dag.serving.frontdoor.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _Sampling,
)

#: Characters per token above which a text cannot fit the context whatever it tokenises to (no token of
#: a BPE vocabulary is this long): such a text is refused without being tokenised.
MAX_CHARS_PER_TOKEN = 64


def encode(engine: FrontDoorEngine, text: str, param: str = "prompt") -> list[int]:
    """``text``'s token ids, no special tokens added (a chat's template has written its own).

    Raises:
        APIError: 400 ``context_length_exceeded`` for a text longer than :data:`MAX_CHARS_PER_TOKEN`
            characters per token of the context (tokenising megabytes would stall the server).
    """
    limit = engine.max_context_tokens
    if limit is not None and len(text) > MAX_CHARS_PER_TOKEN * limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; the {param} holds "
                            f"{len(text)} characters, far more than fit. Please reduce the length of the {param}.",
                       param=param, code="context_length_exceeded")
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def _generation(engine: FrontDoorEngine, body: _Sampling, prompt_ids: list[int], max_tokens: int | None,
                param: str) -> Generation:
    vocab = len(engine.tokenizer)
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
    return Generation(prompt_ids, engine.check_context(len(prompt_ids), max_tokens, param),
                      temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                      stop=tuple(body.stop_sequences), priority_class=body.priority or "online")


def completion_generation(engine: FrontDoorEngine, body: CompletionRequest) -> Generation:
    """A ``/v1/completions`` body as a generation (``max_tokens`` 16 when unset, as OpenAI).

    Raises:
        APIError: 400: several prompts, an empty one, token ids outside the vocabulary, or prompt +
            ``max_tokens`` over the context.
    """
    prompt = body.single_prompt()
    ids = list(prompt) if isinstance(prompt, list) else encode(engine, prompt)
    return _generation(engine, body, ids, body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, "prompt")


def chat_generation(engine: FrontDoorEngine, body: ChatCompletionRequest) -> Generation:
    """A ``/v1/chat/completions`` body as a generation: the messages in the model's chat template
    (``developer`` sent as ``system``), ``max_tokens`` the server's default when unset
    (:meth:`~flexpipe_dag.serving.frontdoor.engine.FrontDoorEngine.check_context`).

    Raises:
        APIError: 400: a model without a chat template, a non-text content part, or prompt +
            ``max_tokens`` over the context.
    """
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    if not getattr(engine.tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return _generation(engine, body, encode(engine, text, "messages"), body.requested_max_tokens, "messages")
