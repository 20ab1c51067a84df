"""Batch jobs: prompts files, malformed rows, sinks, fit refusal, and a 64-prompt Azure-trace job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexpipe_dag.core.errors import InfeasibleError, InputError
from flexpipe_dag.runtime.batch import JsonlSink, read_prompts

FIXTURES = Path(__file__).parent / "fixtures"


def test_jsonl_prompts_count_malformed_rows(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join([
        json.dumps({"id": "a", "prompt": "Hello", "max_new_tokens": 4, "priority": 0}),
        "{not json",
        json.dumps({"prompt": "no id"}),
        json.dumps({"id": "b", "token_ids": [1, 2, 3]}),
        json.dumps({"id": "a", "prompt": "duplicate"}),
        json.dumps({"id": "c"}),
        json.dumps({"id": "d", "prompt": "x", "max_new_tokens": -2}),
        json.dumps({"id": "e", "token_ids": ["x"]}),
    ]) + "\n")
    rows, bad = read_prompts(p, default_max_new_tokens=7)
    assert [r.request_id for r in rows] == ["a", "b"]
    assert rows[1].max_new_tokens == 7 and rows[0].priority == 0
    assert [m.line for m in bad] == [2, 3, 5, 6, 7, 8]
    assert "duplicate" in bad[2].reason and "max_new_tokens" in bad[4].reason


def test_parquet_prompts(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    p = tmp_path / "prompts.parquet"
    pd.DataFrame({"id": ["x", "y"], "prompt": ["Hi", None], "token_ids": [None, [5, 6]],
                  "max_new_tokens": [3, 4], "priority": [1, 0]}).to_parquet(p)
    rows, bad = read_prompts(p)
    assert [(r.request_id, r.token_ids, r.max_new_tokens) for r in rows] == [("x", None, 3), ("y", [5, 6], 4)]
    assert bad == []


def test_bad_prompts_file_names_the_file(tmp_path):
    with pytest.raises(InputError, match="prompts.csv"):
        (tmp_path / "prompts.csv").write_text("id\n1\n")
        read_prompts(tmp_path / "prompts.csv")


def test_jsonl_sink_is_idempotent_and_survives_a_torn_line(tmp_path):
    path = tmp_path / "r.jsonl"
    s = JsonlSink(path)
    s.write({"id": "1", "x": 1})
    s.write({"id": "1", "x": 2})
    with open(path, "a") as fh:
        fh.write('{"id": "2", "x"')  # crash mid-write
    s2 = JsonlSink(path)
    assert s2.done_ids() == {"1"}


def test_gear_that_does_not_fit_is_refused_before_launch():
    pytest.importorskip("torch")
    from test_runtime_helpers import checkpoint, gear

    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions

    g = gear([(0, 10), (10, 30)])
    rt = PipelineRuntime(g, checkpoint(), RuntimeOptions(device_memory_bytes={"cpu0": 10 * 2**30, "cpu1": 200 * 2**20}))
    with pytest.raises(InfeasibleError, match="stage 1 on device 'cpu1'"):
        rt.start()
    assert rt.stage_pids() == []  # nothing launched


@pytest.mark.slow
def test_64_prompts_from_azure_conv_trace_through_two_stages(tmp_path):
    pytest.importorskip("torch")
    from test_runtime_helpers import checkpoint, gear

    from flexpipe_dag.runtime.batch import prompts_from_trace, run_batch_job
    from flexpipe_dag.runtime.pipeline import PipelineRuntime

    ck = checkpoint()
    rows = prompts_from_trace(FIXTURES / "azure_conv_first64.csv", ck.tokenizer(), num_requests=64,
                              max_prompt_tokens=32, max_new_tokens=8)
    assert len(rows) == 64 and max(len(r.token_ids) for r in rows) == 32
    sink = JsonlSink(tmp_path / "out.jsonl")
    with PipelineRuntime(gear([(0, 13), (13, 30)], micro_batch_size=8, inflight=2, kv_capacity_tokens=4096), ck) as rt:
        report = run_batch_job(rt, rows, sink)
    assert report.failure is None and report.finished == 64 and report.malformed == []
    assert sink.done_ids() == {r.request_id for r in rows}
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    by_id = {r.request_id: r for r in rows}
    assert all(1 <= o["output_tokens"] <= by_id[o["id"]].max_new_tokens for o in out)
