"""OpenAI's response objects: a completion or chat completion, its stream chunks, its usage.

Shapes follow https://platform.openai.com/docs/api-reference (``text_completion``,
``chat.completion``, ``chat.completion.chunk``). The Batch API writes the same objects into its
output file, so a batch line's ``response.body`` is what the endpoint would have answered.
"""

from __future__ import annotations

import time
import uuid


class Shapes:
    """How one endpoint writes its response and its stream chunks (one id and creation time per request).

    Args:
        obj: the object type of a whole response; chunk_obj: of a stream chunk.
        prefix: the id's prefix (``cmpl``, ``chatcmpl``).
        model: the served model's name.
    """

    def __init__(self, obj: str, chunk_obj: str, prefix: str, model: str):
        self.obj, self.chunk_obj, self.model = obj, chunk_obj, model
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def head(self, obj: str) -> dict:
        """The fields every response and chunk starts with."""
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, text: str, finish: str | None) -> dict:
        """The one choice of a whole response."""
        raise NotImplementedError

    def delta(self, text: str, finish: str | None, first: bool) -> dict:
        """The one choice of a stream chunk (``first``: the stream's first chunk)."""
        raise NotImplementedError

    def response(self, text: str, finish: str | None, prompt_tokens: int, completion_tokens: int) -> dict:
        """A whole response."""
        return {**self.head(self.obj), "choices": [self.choice(text, finish)],
                "usage": usage(prompt_tokens, completion_tokens)}


class _CompletionShapes(Shapes):
    def choice(self, text: str, finish: str | None) -> dict:
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

    def delta(self, text: str, finish: str | None, first: bool) -> dict:
        return self.choice(text, finish)


class _ChatShapes(Shapes):
    def choice(self, text: str, finish: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                "logprobs": None}

    def delta(self, text: str, finish: str | None, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}


def completion_shapes(model: str) -> Shapes:
    """Shapes of ``/v1/completions``."""
    return _CompletionShapes("text_completion", "text_completion", "cmpl", model)


def chat_shapes(model: str) -> Shapes:
    """Shapes of ``/v1/chat/completions``."""
    return _ChatShapes("chat.completion", "chat.completion.chunk", "chatcmpl", model)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def list_object(data: list[dict], more: bool) -> dict:
    """OpenAI's cursor page: ``data``, its first and last ids, whether more follow (``has_more``: the client's
    auto-pagination then asks again with ``after`` = the last id)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
