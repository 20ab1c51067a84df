"""Shared helpers of the runtime tests (no tests here): model, prompts, gears, HF references."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Count: 1, 2, 3, 4,",
           "The quick brown fox", "Tell me a joke about computers.", "Name three colors.", "What is 2+2?",
           "Describe a cat in one sentence."]
MAX_NEW_TOKENS = 12


@functools.lru_cache(maxsize=1)
def checkpoint():
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint

    return resolve_checkpoint()


@functools.lru_cache(maxsize=1)
def prompt_ids() -> tuple[tuple[int, ...], ...]:
    tok = checkpoint().tokenizer()
    out = []
    for p in PROMPTS:
        enc = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)
        out.append(tuple(enc["input_ids"]))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint().path), dtype=torch.float32).eval()


@functools.lru_cache(maxsize=1)
def hf_reference() -> dict[str, list[int]]:
    """Single-process transformers greedy ``generate``, one prompt at a time: request id -> new tokens."""
    import torch

    ref = {}
    for i, ids in enumerate(prompt_ids()):
        out = hf_model().generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        ref[str(i)] = out[0, len(ids):].tolist()
    return ref


def requests(n: int = len(PROMPTS), prefix: str = ""):
    from flexpipe_dag.runtime.scheduler import Request

    eos = checkpoint().eos_token_ids()
    return [Request(f"{prefix}{i}", list(prompt_ids()[i]), MAX_NEW_TOKENS, eos_token_ids=eos) for i in range(n)]


def gear(ranges, micro_batch_size: int = 8, inflight: int = 2, kv_capacity_tokens: int = 2048, gear_id: str = "g"):
    from flexpipe_dag.core.gear import Gear, StagePlan

    return Gear(gear_id=gear_id, kind="manual", model_name="SmolLM2-135M-Instruct", num_layers=30,
                micro_batch_size=micro_batch_size, max_inflight_micro_batches=inflight,
                kv_capacity_tokens=kv_capacity_tokens, kv_block_size_tokens=16,
                stages=[StagePlan(stage_index=i, layer_start=a, layer_end=b, device_ids=[f"cpu{i}"])
                        for i, (a, b) in enumerate(ranges)])
