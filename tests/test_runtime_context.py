"""The runtime's side of the context rule (issue 13, item 9): a prompt + ``max_new_tokens`` over the model's
max context is refused with a per-request reason while the rest of the batch completes, or, with
``truncate_context``, served with the prompt cut from the left; the batch report counts both."""

from __future__ import annotations

import json

import pytest

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.runtime.kv_blocks import BlockAllocator
from flexpipe_dag.runtime.scheduler import CONTEXT_REFUSAL, ContextLengthError, Request, Scheduler


def test_scheduler_refuses_a_request_over_the_max_context_by_its_numbers():
    sched = Scheduler(BlockAllocator(2048, 16), micro_batch_size=4, max_inflight_micro_batches=1,
                      max_context_tokens=8192)
    sched.add_request(Request("fits", [1] * 8184, 8))  # exactly 8192
    with pytest.raises(ContextLengthError) as err:
        sched.add_request(Request("long", [1] * 8190, 16))
    msg = str(err.value)
    assert "'long'" in msg and "prompt 8190 + max_new_tokens 16 = 8206 tokens" in msg and "8192" in msg
    assert CONTEXT_REFUSAL in msg and isinstance(err.value, ValueError)  # the driver reports ValueErrors as refusals
    assert sched.num_waiting == 1
    Scheduler(BlockAllocator(4, 16), 1, 1).add_request(Request("no-limit", [1] * 50, 8))  # None: not checked


def test_smollm2_max_context_is_read_from_its_config_and_an_option_may_only_lower_it():
    pytest.importorskip("torch")
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
    from tests.test_runtime_helpers import checkpoint, gear

    ck = checkpoint()
    assert ck.max_context_tokens == ck.config.max_position_embeddings == 8192
    assert PipelineRuntime(gear([(0, 30)]), ck).max_context_tokens == 8192
    assert PipelineRuntime(gear([(0, 30)]), ck, RuntimeOptions(max_context_tokens=64)).max_context_tokens == 64
    with pytest.raises(InputError, match="max_context_tokens: 9000 tokens exceeds .* 8192"):
        _ = PipelineRuntime(gear([(0, 30)]), ck, RuntimeOptions(max_context_tokens=9000)).max_context_tokens


@pytest.mark.slow
def test_over_long_prompt_is_refused_while_the_batch_completes_then_truncated_when_asked(tmp_path):
    """One single-stage pipeline served at a 64-token context (``max_context_tokens``: the same path as
    SmolLM2's own 8,192, with prompts short enough for a CPU)."""
    pytest.importorskip("torch")
    from flexpipe_dag.runtime.batch import JsonlSink, PromptRow, run_batch_job
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
    from tests.test_runtime_helpers import checkpoint, gear, prompt_ids

    short = [list(ids) for ids in prompt_ids()[:3]]
    assert all(len(ids) + 8 <= 64 for ids in short)
    long_ids = [t for ids in prompt_ids() for t in ids][:100]  # 100 + 8 > 64
    rows = [PromptRow(f"ok{i}", token_ids=ids, max_new_tokens=8) for i, ids in enumerate(short)]
    rows.insert(1, PromptRow("too-long", token_ids=long_ids, max_new_tokens=8))
    with PipelineRuntime(gear([(0, 30)], micro_batch_size=4), checkpoint(),
                         RuntimeOptions(max_context_tokens=64)) as rt:
        sink = JsonlSink(tmp_path / "refuse.jsonl")
        report = run_batch_job(rt, rows, sink)
        assert report.failure is None and report.finished == 3 and sink.done_ids() == {"ok0", "ok1", "ok2"}
        assert set(report.refused) == {"too-long"} and report.refused_context == 1 and report.over_context == 1
        why = report.refused["too-long"]
        assert "prompt 100 + max_new_tokens 8 = 108 tokens exceed the model's max context of 64 tokens" in why

        rt.options.truncate_context = True  # read at submit
        sink = JsonlSink(tmp_path / "truncate.jsonl")
        report = run_batch_job(rt, [PromptRow("cut", token_ids=long_ids, max_new_tokens=8)], sink)
        assert report.failure is None and report.finished == 1 and not report.refused
        assert list(report.truncated) == ["cut"] and "prompt 100 -> 56 tokens" in report.truncated["cut"]
        assert report.over_context == 1 and report.refused_context == 0
        [out] = [json.loads(line) for line in (tmp_path / "truncate.jsonl").read_text().splitlines()]
        assert out["prompt_tokens"] == 56 and 1 <= out["output_tokens"] <= 8
