"""Multi-process pipeline: exact greedy output for 1, 2, 3 stages, reconfiguration, failures, re-runs."""

from __future__ import annotations

import json
import os
import signal

import pytest

pytest.importorskip("torch")

from test_runtime_helpers import checkpoint, gear, hf_reference, prompt_ids, requests  # noqa: E402

from flexpipe_dag.runtime.batch import JsonlSink, PromptRow, run_batch_job  # noqa: E402
from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions, StageFailedError  # noqa: E402

pytestmark = pytest.mark.slow


def _check(outs, reqs):
    ref = hf_reference()
    assert {o.request_id: o.output_token_ids for o in outs} == {r.request_id: ref[r.request_id.split("-")[-1]]
                                                                 for r in reqs}


@pytest.mark.parametrize("first,second", [
    ([(0, 15), (15, 30)], [(0, 4), (4, 30)]),
    ([(0, 10), (10, 20), (20, 30)], [(0, 2), (2, 25), (25, 30)]),
])
def test_pipeline_matches_hf_generate_even_then_uneven(first, second):
    hf_reference()  # computed before the workers start competing for the CPU
    with PipelineRuntime(gear(first, micro_batch_size=8), checkpoint()) as rt:
        assert [(i["layer_start"], i["layer_end"]) for i in rt.stage_info] == first
        reqs = requests(prefix="a-")
        _check(rt.generate(reqs), reqs)  # batch size 8
        info = rt.reconfigure(gear(second, micro_batch_size=1, gear_id="g2"))  # same processes, new ranges
        assert [(i["layer_start"], i["layer_end"]) for i in info] == second
        assert [i["pid"] for i in info] == rt.stage_pids()
        reqs = requests(prefix="b-")
        samples = []
        _check(rt.generate(reqs, on_metrics=samples.append), reqs)  # batch size 1, 2 micro-batches in flight


def test_single_stage_pipeline_and_live_metrics():
    with PipelineRuntime(gear([(0, 30)], micro_batch_size=8), checkpoint(),
                         RuntimeOptions(metrics_period_s=0.5)) as rt:
        samples = []
        reqs = requests(prefix="c-")
        _check(rt.generate(reqs, on_metrics=samples.append), reqs)
        assert rt.stage_info[0]["param_bytes"] > 0 and rt.stage_info[0]["kv_capacity_tokens"] == 2048
    assert samples and all(s.source == "live" and len(s.stages) == 1 for s in samples)
    assert any(s.stages[0].busy_fraction > 0 for s in samples)


def test_killed_stage_fails_cleanly_and_rerun_finishes_only_missing(tmp_path):
    ref = hf_reference()
    rows = [PromptRow(str(i), token_ids=list(ids), max_new_tokens=12) for i, ids in enumerate(prompt_ids())]
    sink_path = tmp_path / "results.jsonl"
    g = gear([(0, 12), (12, 30)], micro_batch_size=2, inflight=2)
    with PipelineRuntime(g, checkpoint()) as rt:
        victim = rt.stage_pids()[1]

        def kill_after_two(done, total):
            if done == 2:
                os.kill(victim, signal.SIGKILL)

        report = run_batch_job(rt, rows, JsonlSink(sink_path), on_progress=kill_after_two)
    assert report.failure is not None and report.failure.startswith("stage 1 failed"), report.failure
    kept = [json.loads(line) for line in sink_path.read_text().splitlines()]
    assert 2 <= len(kept) < len(rows)
    with PipelineRuntime(g, checkpoint()) as rt:
        report2 = run_batch_job(rt, rows, JsonlSink(sink_path))
    assert report2.failure is None
    assert report2.skipped_done == len(kept) and report2.submitted == len(rows) - len(kept)
    final = [json.loads(line) for line in sink_path.read_text().splitlines()]
    assert sorted(r["id"] for r in final) == sorted(r.request_id for r in rows)  # each exactly once
    assert all(r["output_token_ids"] == ref[r["id"]] for r in final)


def test_hung_stage_is_named_by_the_watchdog():
    g = gear([(0, 20), (20, 30)], micro_batch_size=2, inflight=2)
    with PipelineRuntime(g, checkpoint(), RuntimeOptions(step_timeout_s=3.0)) as rt:
        victim = rt.stage_pids()[0]
        got = []

        def freeze_stage0(out):
            got.append(out)
            if len(got) == 1:
                os.kill(victim, signal.SIGSTOP)

        with pytest.raises(StageFailedError) as err:
            rt.generate(requests(prefix="h-"), on_result=freeze_stage0)
    assert err.value.stage == 0 and "watchdog" in err.value.reason
    assert len(err.value.finished) >= 1
