"""Multi-process pipeline: exact greedy output for 1, 2, 3 stages (even / uneven, batch 1 / 8),
reconfiguration, a 64-prompt trace job, a killed stage, a re-run, a hung stage.

Starting a pipeline (spawn, imports, gloo, weights) is the expensive part, so one 2-stage pipeline
serves the whole module (``two_stage``; reconfigured in place between splits, which also exercises
the reconfiguration hook) and the 1- and 3-stage pipelines are started once each. Tests that end a
pipeline come last in their pipeline's life: the 3-stage one is killed by its own test, the shared
2-stage one by the watchdog test at the end of the file.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("torch")

from flexpipe_dag.runtime.batch import JsonlSink, PromptRow, prompts_from_trace, run_batch_job
from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions, StageFailedError
from tests.test_runtime_helpers import (
    MAX_NEW_TOKENS,
    checkpoint,
    gear,
    hf_reference,
    prompt_ids,
    requests,
    signal_after_first_result,
)

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures"
EVEN2, UNEVEN2 = [(0, 15), (15, 30)], [(0, 4), (4, 30)]
EVEN3, UNEVEN3 = [(0, 10), (10, 20), (20, 30)], [(0, 2), (2, 25), (25, 30)]


def _check(outs, reqs):
    ref = hf_reference()
    assert {o.request_id: o.output_token_ids for o in outs} == {r.request_id: ref[r.request_id.split("-")[-1]]
                                                                 for r in reqs}


def _use(rt: PipelineRuntime, ranges, micro_batch_size: int, gear_id: str, **kw) -> None:
    """Move a running pipeline to ``ranges`` / ``micro_batch_size`` (same processes) unless it is there."""
    if rt.gear.layer_ranges() == ranges and rt.gear.micro_batch_size == micro_batch_size and not kw:
        return
    info = rt.reconfigure(gear(ranges, micro_batch_size=micro_batch_size, gear_id=gear_id, **kw))
    assert [(i["layer_start"], i["layer_end"]) for i in info] == ranges
    assert [i["pid"] for i in info] == rt.stage_pids()  # no restart


@pytest.fixture(scope="module")
def two_stage():
    hf_reference()  # computed (or read from the cache) before the workers compete for the CPU
    with PipelineRuntime(gear(EVEN2, micro_batch_size=8), checkpoint()) as rt:
        assert [(i["layer_start"], i["layer_end"]) for i in rt.stage_info] == EVEN2
        yield rt


@pytest.mark.parametrize("ranges", [EVEN2, UNEVEN2], ids=["even", "uneven"])
@pytest.mark.parametrize("micro_batch_size", [8, 1])
def test_two_stages_match_hf_generate(two_stage, ranges, micro_batch_size):
    _use(two_stage, ranges, micro_batch_size, f"g2-{len(ranges)}-{micro_batch_size}")
    reqs = requests(8 if micro_batch_size == 8 else 3, prefix=f"2s{micro_batch_size}{ranges[0][1]}-")
    _check(two_stage.generate(reqs), reqs)  # batch 1: one sequence per micro-batch, 2 micro-batches in flight


def test_64_prompts_from_azure_conv_trace_through_two_stages(two_stage, tmp_path):
    ck = checkpoint()
    rows = prompts_from_trace(FIXTURES / "azure_conv_first64.csv", ck.tokenizer(), num_requests=64,
                              max_prompt_tokens=64, max_new_tokens=8, length_scale=1 / 32)  # 374 -> 12 tokens
    lengths = [len(r.token_ids) for r in rows]
    assert len(rows) == 64 and max(lengths) == 64 and min(lengths) == 1 and len(set(lengths)) > 10
    _use(two_stage, [(0, 13), (13, 30)], 8, "azure", kv_capacity_tokens=4096)
    sink = JsonlSink(tmp_path / "out.jsonl")
    report = run_batch_job(two_stage, rows, sink)
    assert report.failure is None and report.finished == len(rows) and report.malformed == []
    assert sink.done_ids() == {r.request_id for r in rows}
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    by_id = {r.request_id: r for r in rows}
    assert all(1 <= o["output_tokens"] <= by_id[o["id"]].max_new_tokens for o in out)


def test_a_cancelled_request_ends_within_a_step_and_the_others_are_untouched(two_stage):
    from flexpipe_dag.runtime.scheduler import Request

    _use(two_stage, EVEN2, 8, "g2-2-8")
    reqs = requests(3, prefix="cancel-")
    long_one = Request("cancel-long", list(prompt_ids()[0]), 1500)  # no EOS: it would run 1500 steps
    ended: list = []

    def on_result(out):
        ended.append(out)
        if len(ended) == 1:  # the first of the others finished: the long one is running
            two_stage.cancel(["cancel-long", "never-submitted"])

    outs = two_stage.generate([long_one, *reqs], on_result=on_result)
    by_id = {o.request_id: o for o in outs}
    assert set(by_id) == {"cancel-long", *(r.request_id for r in reqs)} and two_stage.num_outstanding == 0
    aborted = by_id.pop("cancel-long")
    assert aborted.finish_reason == "abort" and 1 <= len(aborted.output_token_ids) <= 2 * MAX_NEW_TOKENS
    ref, got = hf_reference()["0"], aborted.output_token_ids
    n = min(len(ref), len(got))
    assert got[:n] == ref[:n]  # what it had sampled is kept (greedy: the reference's tokens)
    _check(list(by_id.values()), reqs)
    _check(two_stage.generate(reqs2 := requests(3, prefix="after-cancel-")), reqs2)  # its KV blocks were freed


def test_three_stages_match_hf_then_killed_stage_fails_cleanly_and_rerun_finishes_only_missing(two_stage, tmp_path):
    ref = hf_reference()
    with PipelineRuntime(gear(EVEN3, micro_batch_size=8), checkpoint()) as rt:
        reqs = requests(prefix="3s8-")
        _check(rt.generate(reqs), reqs)  # even, batch 8
        _use(rt, UNEVEN3, 1, "g3-uneven-1")
        reqs = requests(3, prefix="3s1-")
        _check(rt.generate(reqs), reqs)  # uneven, batch 1

        # a batch job through the same processes; stage 1 (the middle one) is killed mid-run
        _use(rt, UNEVEN3, 2, "g3-uneven-2")
        rows = [PromptRow(str(i), token_ids=list(ids), max_new_tokens=12) for i, ids in enumerate(prompt_ids())]
        sink_path = tmp_path / "results.jsonl"
        victim = rt.stage_pids()[1]

        def kill_after_two(done, total):
            if done == 2:
                os.kill(victim, signal.SIGKILL)

        report = run_batch_job(rt, rows, JsonlSink(sink_path), on_progress=kill_after_two)
    assert report.failure is not None and report.failure.startswith("stage 1 failed"), report.failure
    kept = [json.loads(line) for line in sink_path.read_text().splitlines()]
    assert 2 <= len(kept) < len(rows)

    _use(two_stage, [(0, 12), (12, 30)], 2, "rerun")  # re-run on another (live) pipeline
    report2 = run_batch_job(two_stage, rows, JsonlSink(sink_path))
    assert report2.failure is None
    assert report2.skipped_done == len(kept) and report2.submitted == len(rows) - len(kept)
    final = [json.loads(line) for line in sink_path.read_text().splitlines()]
    assert sorted(r["id"] for r in final) == sorted(r.request_id for r in rows)  # each exactly once
    assert all(r["output_token_ids"] == ref[r["id"]] for r in final)


def test_single_stage_pipeline_and_live_metrics():
    hf_reference()
    with PipelineRuntime(gear([(0, 30)], micro_batch_size=8), checkpoint(),
                         RuntimeOptions(metrics_period_s=0.5)) as rt:
        samples = []
        reqs = requests(prefix="1s8-")
        _check(rt.generate(reqs, on_metrics=samples.append), reqs)
        assert rt.stage_info[0]["param_bytes"] > 0 and rt.stage_info[0]["kv_capacity_tokens"] == 2048
        _use(rt, [(0, 30)], 1, "g1-1")
        reqs = requests(3, prefix="1s1-")
        _check(rt.generate(reqs), reqs)
    assert samples and all(s.source == "live" and len(s.stages) == 1 for s in samples)
    assert any(s.stages[0].busy_fraction > 0 for s in samples)


def test_chunked_prefill_through_two_stage_processes_matches_hf_generate():
    """The driver's scheduler cuts prompts into 7-token chunks that share micro-batches with decodes
    (two in flight); the stage workers reproduce transformers exactly."""
    hf_reference()
    opts = RuntimeOptions(max_tokens_per_micro_batch=7, chunked_prefill=True)
    with PipelineRuntime(gear(UNEVEN2, micro_batch_size=4), checkpoint(), opts) as rt:
        reqs = requests(prefix="chunk-")
        _check(rt.generate(reqs), reqs)


def test_hung_stage_is_named_by_the_watchdog(two_stage):
    """Last user of ``two_stage``: the watchdog ends that pipeline."""
    _use(two_stage, [(0, 20), (20, 30)], 2, "hang")
    two_stage.options.step_timeout_s = 10.0  # read live by the watchdog (3 s named a busy stage 1 on a loaded host)
    got = []
    freeze_stage0 = signal_after_first_result(two_stage.stage_pids()[0], signal.SIGSTOP, got)
    with pytest.raises(StageFailedError) as err:
        two_stage.generate(requests(prefix="h-"), on_result=freeze_stage0)
    assert err.value.stage == 0 and "watchdog" in err.value.reason, err.value
    assert len(err.value.finished) >= 1
