"""KV-cache arithmetic the runtime, the simulator and the planner share."""

from __future__ import annotations


def kv_tokens_needed(prompt_tokens: int, max_new_tokens: int) -> int:
    """KV-cache tokens a request can ever hold: ``prompt_tokens + max_new_tokens - 1``.

    The prompt's tokens and every generated token but the last are fed through the model (their keys
    and values written to the pool); the last sampled token is returned and the sequence ends, so it
    is never written. The runtime's reservation, admission and refusal and the simulator's refusal
    all use this one figure.

    Args:
        prompt_tokens: the prompt's length, >= 1.
        max_new_tokens: the most tokens the request generates, >= 1.
    """
    return prompt_tokens + max_new_tokens - 1
