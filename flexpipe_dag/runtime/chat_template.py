"""Plain-text prompts for chat models: wrap each in the tokenizer's chat template, or say why not.

A chat (instruction-tuned) model expects its prompts in its chat template (``<|im_start|>user ...
<|im_start|>assistant``); given bare text it may answer with an end-of-sequence token at once, so a
batch stores empty outputs. :func:`resolve_chat_template` decides, once per job, from a mode:

* ``auto`` (the default of the batch job and ``flexpipe run``): wrap a *plain-text* prompt (a
  ``prompt`` holding none of the tokenizer's special tokens) when the tokenizer has a chat template;
  a prompt already in a template's form and a ``token_ids`` row are sent as they are;
* ``on``: the same, but a tokenizer without a chat template is refused (nothing is served);
* ``off``: every prompt as it is; a chat model given plain-text prompts gets a warning.

A wrapped prompt is one user message with the template's generation prompt after it
(``add_generation_prompt=True``), tokenised with the special tokens the template writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from flexpipe_dag.core.errors import InputError

#: How a job treats plain-text prompts (see module docstring).
ChatTemplateMode = Literal["auto", "on", "off"]
CHAT_TEMPLATE_MODES: tuple[str, ...] = get_args(ChatTemplateMode)


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` (a ``transformers`` tokenizer) carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def is_plain_text(prompt: str, special_tokens: Sequence[str]) -> bool:
    """Whether ``prompt`` holds none of ``special_tokens`` (text such as ``<|im_start|>``): not yet templated."""
    return not any(t and t in prompt for t in special_tokens)


@dataclass(frozen=True)
class PromptFormat:
    """How a job's text prompts are tokenised.

    Attributes:
        apply: wrap plain-text prompts in the chat template.
        plain_prompts: rows of the job holding a plain-text prompt.
        message: one line for the run's log (None: nothing to say).
        warn: whether ``message`` is a warning (a chat model given plain text without its template).
    """

    apply: bool
    plain_prompts: int
    message: str | None = None
    warn: bool = False


def resolve_chat_template(mode: str, tokenizer, model_name: str, prompts: Sequence[str | None],
                          source: str = "chat_template") -> PromptFormat:
    """Decide how the plain-text prompts of one job are sent (see module docstring).

    Args:
        mode: ``auto``, ``on`` or ``off``.
        tokenizer: the model's tokenizer.
        model_name: named in the messages.
        prompts: each row's ``prompt`` text (None for a ``token_ids`` row).
        source: where ``mode`` came from, for errors (``chat_template`` in a job config, ``--chat-template``).

    Raises:
        InputError: ``mode`` is not one of :data:`CHAT_TEMPLATE_MODES`, or ``on`` for a tokenizer without
            a chat template.
    """
    if mode not in CHAT_TEMPLATE_MODES:
        raise InputError(None, source, f"expected one of {', '.join(CHAT_TEMPLATE_MODES)}, got {mode!r}")
    templated = has_chat_template(tokenizer)
    if mode == "on" and not templated:
        raise InputError(None, source, f"'on', but {model_name}'s tokenizer has no chat template; "
                                       "use auto or off to send the prompts as they are")
    special = list(getattr(tokenizer, "all_special_tokens", ()))
    plain = sum(1 for p in prompts if p is not None and is_plain_text(p, special))
    if not templated or plain == 0:
        return PromptFormat(False, plain)
    if mode == "off":
        return PromptFormat(False, plain, f"{model_name} is a chat model (its tokenizer has a chat template) and "
                                          f"{plain} prompt(s) are plain text sent without it ({source}: off): "
                                          "it may answer them with an end-of-sequence token and no text; "
                                          f"{source}: auto wraps them", warn=True)
    return PromptFormat(True, plain, f"{plain} plain-text prompt(s) wrapped in {model_name}'s chat template as a "
                                     f"user message ({source}: {mode}; off sends them as they are)")


def prompt_token_ids(tokenizer, prompt: str, apply_template: bool) -> list[int]:
    """Token ids of one text prompt: wrapped in the chat template when ``apply_template`` and the prompt
    is plain text, else as it is (no special tokens added)."""
    if apply_template and is_plain_text(prompt, list(getattr(tokenizer, "all_special_tokens", ()))):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=False)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
