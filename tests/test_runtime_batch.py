"""Batch jobs: prompts files, malformed rows, sinks, refusals before launch (the 64-prompt Azure-trace job
runs on the shared pipeline in test_runtime_pipeline.py)."""

from __future__ import annotations

import json

import pytest

from flexpipe_dag.core.errors import InfeasibleError, InputError
from flexpipe_dag.runtime.batch import JsonlSink, prompts_from_trace, read_prompts


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
    rows, bad = read_prompts(p, max_new_tokens=7)
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
    # an integer id column is its text; an integer column with a gap reads as floats: the gap is the default
    q = tmp_path / "gaps.parquet"
    pd.DataFrame({"id": [10, 11, 12], "prompt": ["a", "b", "c"], "max_new_tokens": [3, None, 2.5]}).to_parquet(q)
    rows, bad = read_prompts(q, max_new_tokens=8)
    assert [(r.request_id, r.max_new_tokens) for r in rows] == [("10", 3), ("11", 8)]
    assert [b.line for b in bad] == [3] and bad[0].reason.endswith("got 2.5")
    # pandas' nullable types (pd.NA) are missing values; a list column of doubles holds whole token ids
    r = tmp_path / "nullable.parquet"
    pd.DataFrame({"id": pd.array(["a", "b"], dtype="string"), "prompt": pd.array(["x", None], dtype="string"),
                  "token_ids": [None, [5.0, 6.0]], "continuations": [[[1, 2], [3]], None],
                  "max_new_tokens": pd.array([2, None], dtype="Int64")}).to_parquet(r)
    rows, bad = read_prompts(r, max_new_tokens=8)
    assert bad == [] and [(x.request_id, x.prompt, x.token_ids, x.max_new_tokens) for x in rows] == [
        ("a", "x", None, 2), ("b", None, [5, 6], 8)]
    assert rows[0].continuations == [[1, 2], [3]]


def test_bad_prompts_file_names_the_file(tmp_path):
    with pytest.raises(InputError, match="prompts.csv"):
        (tmp_path / "prompts.csv").write_text("id\n1\n")
        read_prompts(tmp_path / "prompts.csv")


def test_jsonl_sink_is_idempotent_and_survives_a_torn_line(tmp_path):
    path = tmp_path / "r.jsonl"
    s = JsonlSink(path)
    s.write({"id": "1", "gear_id": "g", "x": 1})
    s.write({"id": "1", "gear_id": "g", "x": 2})
    with open(path, "a") as fh:
        fh.write('{"id": "2", "x"')  # crash mid-write
    s2 = JsonlSink(path)
    assert s2.done_ids() == {"1"}


def test_gear_that_does_not_fit_is_refused_before_launch():
    pytest.importorskip("torch")
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
    from tests.test_runtime_helpers import checkpoint, gear

    g = gear([(0, 10), (10, 30)])
    rt = PipelineRuntime(g, checkpoint(), RuntimeOptions(device_memory_bytes={"cpu0": 10 * 2**30, "cpu1": 200 * 2**20}))
    with pytest.raises(InfeasibleError, match="stage 1 on device 'cpu1'"):
        rt.start()
    assert rt.stage_pids() == []  # nothing launched


def test_replica_that_does_not_fit_its_device_is_refused_before_launch():
    pytest.importorskip("torch")
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
    from tests.test_runtime_helpers import checkpoint, gear

    g = gear([(0, 10), (10, 30)], device_ids=[["cpu0"], ["cpu1", "cpu2"]])
    rt = PipelineRuntime(g, checkpoint(), RuntimeOptions(device_memory_bytes={"cpu2": 200 * 2**20}))
    with pytest.raises(InfeasibleError, match="stage 1 on device 'cpu2'"):
        rt.start()
    assert rt.stage_pids() == []  # nothing launched


def test_continuations_for_scoring_rows(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"id": "mc", "prompt": "Sky:", "continuations": [" blue", [5, 6]]},
        {"id": "plain", "prompt": "Hi"},
        {"id": "empty", "prompt": "x", "continuations": []},
        {"id": "bad", "prompt": "x", "continuations": ["", "y"]},
        {"id": "neg", "prompt": "x", "continuations": [[-1]]},
    ]) + "\n")
    rows, bad = read_prompts(p)
    assert [(r.request_id, r.continuations) for r in rows] == [("mc", [" blue", [5, 6]]), ("plain", None)]
    assert [m.line for m in bad] == [3, 4, 5] and all("continuations" in m.reason for m in bad)


def test_unknown_start_method_is_refused_before_launch():
    pytest.importorskip("torch")
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions
    from tests.test_runtime_helpers import checkpoint, gear

    rt = PipelineRuntime(gear([(0, 30)]), checkpoint(), RuntimeOptions(start_method="fork"))
    with pytest.raises(InputError, match="start_method: expected 'forkserver' or 'spawn'"):
        rt.start()
    assert rt.stage_pids() == []


@pytest.mark.parametrize("cells, field", [("abc,5", "row 2.ContextTokens"), (",5", "row 2.ContextTokens"),
                                          ("10.5,5", "row 2.ContextTokens"), ("-50,5", "row 2.ContextTokens"),
                                          ("10,0", "row 2.GeneratedTokens")])
def test_trace_rows_with_bad_token_counts_are_named(tmp_path, cells, field):
    """``run --trace``: a token count that is not an integer >= 1 is an InputError naming the row and the
    column (it was a ValueError traceback, and a negative count silently became 1)."""
    trace = tmp_path / "t.csv"
    trace.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,12,3\n"
                     f"2023-11-16 18:15:47.0000000,{cells}\n")

    def tokenizer(text, add_special_tokens=False):
        return {"input_ids": list(range(100))}

    with pytest.raises(InputError) as e:
        prompts_from_trace(trace, tokenizer, num_requests=2, max_prompt_tokens=64, max_new_tokens=8)
    assert e.value.source == str(trace) and e.value.field == field
    rows = prompts_from_trace(trace, tokenizer, num_requests=1, max_prompt_tokens=64, max_new_tokens=8)
    assert [(len(r.token_ids), r.max_new_tokens) for r in rows] == [(12, 3)]  # rows not used are not read
