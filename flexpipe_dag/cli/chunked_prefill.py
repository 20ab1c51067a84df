"""``--chunked-prefill-tokens``: the flag `flexpipe run`, `serve` and `simulate` share.

With it, prompts are cut into chunks that fill a micro-batch's token budget after its decodes
(Sarathi-Serve, OSDI'24; vLLM's ``--enable-chunked-prefill`` with ``--max-num-batched-tokens``): the
runtime scheduler and the simulator apply the same rule
(:class:`~flexpipe_dag.runtime.scheduler.Scheduler`, :class:`~flexpipe_dag.sim.config.SimConfig`).
"""

from __future__ import annotations

import argparse

from flexpipe_dag.core.errors import InputError

FLAG = "--chunked-prefill-tokens"


def add_chunked_prefill_argument(p: argparse.ArgumentParser) -> None:
    """Add ``--chunked-prefill-tokens N`` to ``p`` (default: whole-prompt prefill)."""
    p.add_argument(FLAG, type=int, default=None, metavar="N",
                   help="cut prompts into chunks so that each micro-batch holds at most N tokens (one per decode, "
                        "prompt chunks fill the rest, so at most N sequences): a long prompt no longer stalls the "
                        "decodes beside it, at the cost of its own TTFT (default: whole prompts, up to 2048 tokens "
                        "per micro-batch)")


#: Largest budget accepted (vLLM's ``max_num_batched_tokens`` is of this order at most).
MAX_TOKENS = 1 << 20


def chunked_prefill_tokens(args: argparse.Namespace) -> int | None:
    """The token budget asked for with ``--chunked-prefill-tokens``, or ``None`` when not given.

    Raises:
        InputError: the budget is not in 1..:data:`MAX_TOKENS`.
    """
    n = getattr(args, "chunked_prefill_tokens", None)
    if n is not None and not 1 <= n <= MAX_TOKENS:
        raise InputError(None, FLAG, f"expected 1..{MAX_TOKENS} tokens per micro-batch, got {n}")
    return n


def chunked_runtime_options(args: argparse.Namespace) -> dict:
    """:class:`~flexpipe_dag.runtime.pipeline.RuntimeOptions` fields for the flag (none when not given).

    Raises:
        InputError: as :func:`chunked_prefill_tokens`.
    """
    n = chunked_prefill_tokens(args)
    return {} if n is None else {"max_tokens_per_micro_batch": n, "chunked_prefill": True}
