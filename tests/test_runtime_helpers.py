"""Shared helpers of the runtime tests (no tests here): model, prompts, gears, transformers references.

Two things are slow and never change between test sessions, so they are cached on disk under
``FLEXPIPE_TEST_CACHE`` (default ``<tmp>/flexpipe-test-cache-<uid>``):

* the GGUF -> safetensors conversion of SmolLM2 (keyed by the GGUF file, as the runtime keys it;
  shared with the other test modules through ``FLEXPIPE_TEST_MODEL_CACHE``, see tests/support.py);
* the single-process ``transformers`` references (greedy ``generate`` outputs, prompt log-probs),
  keyed by the converted checkpoint, the torch and transformers versions, and the exact inputs.

A cold cache computes both once (about 30 s); the tests compare the runtime against the cached
reference exactly as they would against a fresh one. Delete the directory to recompute.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Count: 1, 2, 3, 4,",
           "The quick brown fox", "Tell me a joke about computers.", "Name three colors.", "What is 2+2?",
           "Describe a cat in one sentence."]
MAX_NEW_TOKENS = 12
TEST_CACHE = Path(os.environ.get("FLEXPIPE_TEST_CACHE")
                  or Path(tempfile.gettempdir()) / f"flexpipe-test-cache-{os.getuid()}")


@functools.lru_cache(maxsize=1)
def checkpoint():
    """SmolLM2-135M-Instruct, converted once into the machine's shared test model cache (the same
    directory, ``tests.support.MODEL_CACHE``, that conftest.py gives every test as
    ``FLEXPIPE_MODEL_CACHE``; named explicitly here because module-scoped fixtures run before that
    per-test setting)."""
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint

    return resolve_checkpoint(cache_dir=os.environ.get("FLEXPIPE_TEST_MODEL_CACHE") or TEST_CACHE / "models")


def cached_reference(name: str, inputs, compute):
    """``compute()``'s JSON result, cached under a key of ``inputs``, the checkpoint and library versions."""
    import torch
    import transformers

    key_src = json.dumps({"inputs": inputs, "checkpoint": checkpoint().path.name, "torch": torch.__version__,
                          "transformers": transformers.__version__}, sort_keys=True)
    path = TEST_CACHE / "references" / f"{name}-{hashlib.sha256(key_src.encode()).hexdigest()[:16]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)  # atomic: a concurrent session never reads half a file
    return value


@functools.lru_cache(maxsize=1)
def prompt_ids() -> tuple[tuple[int, ...], ...]:
    """Each of :data:`PROMPTS` as a chat turn (SmolLM2's template adds its default system prompt:
    30-40 tokens per prompt, so every prompt spans several 16-token KV blocks)."""
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

    def compute():
        import torch

        ref = {}
        for i, ids in enumerate(prompt_ids()):
            out = hf_model().generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            ref[str(i)] = out[0, len(ids):].tolist()
        return ref

    return cached_reference("generate", {"prompt_ids": prompt_ids(), "max_new_tokens": MAX_NEW_TOKENS}, compute)


def hf_token_logprobs(sequences: list[list[int]]) -> list[list[float]]:
    """Single-process transformers forward, one sequence at a time: ``log p(x[j+1] | x[:j+1])`` per sequence."""

    def compute():
        import torch

        out = []
        with torch.inference_mode():
            for ids in sequences:
                logits = hf_model()(torch.tensor([ids])).logits[0, :-1].float()
                lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
                out.append(lp.tolist())
        return out

    return cached_reference("logprobs", {"sequences": sequences}, compute)


def requests(n: int = len(PROMPTS), prefix: str = ""):
    from flexpipe_dag.runtime.scheduler import Request

    eos = checkpoint().eos_token_ids()
    return [Request(f"{prefix}{i}", list(prompt_ids()[i]), MAX_NEW_TOKENS, eos_token_ids=eos) for i in range(n)]


def signal_after_first_result(pid: int, sig: int, got: list):
    """An ``on_result`` callback that appends each output to ``got`` and sends ``sig`` to ``pid``
    when the first one arrives (a stage killed or frozen while work is in flight)."""

    def on_result(out) -> None:
        got.append(out)
        if len(got) == 1:
            os.kill(pid, sig)

    return on_result


def gear(ranges, micro_batch_size: int = 8, inflight: int = 2, kv_capacity_tokens: int = 2048, gear_id: str = "g",
         device_ids=None):
    from flexpipe_dag.core.gear import Gear, StagePlan

    return Gear(gear_id=gear_id, kind="manual", model_name="SmolLM2-135M-Instruct", num_layers=30,
                micro_batch_size=micro_batch_size, max_inflight_micro_batches=inflight,
                kv_capacity_tokens=kv_capacity_tokens, kv_block_size_tokens=16,
                stages=[StagePlan(stage_index=i, layer_start=a, layer_end=b,
                                  device_ids=(device_ids[i] if device_ids else [f"cpu{i}"]))
                        for i, (a, b) in enumerate(ranges)])


def test_process_stopped_reads_the_os_state():
    import signal
    import subprocess
    import sys

    from flexpipe_dag.core.host import process_stopped
    from tests.support import wait_until

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not process_stopped(proc.pid)
        proc.send_signal(signal.SIGSTOP)
        wait_until(lambda: process_stopped(proc.pid), 10.0, "the child to show as stopped")
        proc.send_signal(signal.SIGCONT)
        wait_until(lambda: not process_stopped(proc.pid), 10.0, "the child to run again")
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert not process_stopped(proc.pid)  # gone: unknown is not stopped
