"""Prefill-only scoring on DeepSpeed's PipelineModule: planning, records, and scores vs transformers."""

from __future__ import annotations

import json

import pytest

from flexpipe_dag.runtime.scoring import (
    FILLER,
    RowScores,
    ScoreUnit,
    build_units,
    gear_parts,
    padded_rows,
    plan_score_batches,
    score_record,
    unit_logprobs,
)


def test_units_score_the_prompt_or_each_continuation():
    assert build_units("a", [5, 6, 7], None) == [ScoreUnit("a", (5, 6, 7), 1)]
    assert build_units("b", [5, 6], [[7], [8, 9]]) == [ScoreUnit("b", (5, 6, 7), 2, 0), ScoreUnit("b", (5, 6, 8, 9), 2, 1)]
    for prompt, conts, why in [([5], None, "one-token prompt"), ([], None, "no tokens"), ([5], [[]], "continuation 0")]:
        with pytest.raises(ValueError, match=why):
            build_units("x", prompt, conts)


def test_plan_packs_equal_padded_lengths_longest_first_with_fillers():
    units = [ScoreUnit(str(i), tuple(range(n)), 1) for i, n in enumerate([3, 12, 5, 9, 16, 2, 7])]
    plan = plan_score_batches(units, micro_batch_size=2, max_micro_batches=2, pad_multiple=8)
    assert [(b.length_tokens, b.micro_batches) for b in plan] == [
        (16, [[4, 1], [3, FILLER]]),  # 16, 12, 9 tokens -> 16
        (8, [[6, 2], [0, 5]]),  # 7, 5, 3, 2 -> 8
    ]
    assert sorted(u for b in plan for mb in b.micro_batches for u in mb if u != FILLER) == list(range(len(units)))
    rows = padded_rows(plan[0], units, pad_token_id=0)
    assert [len(r) for mb in rows for r in mb] == [16] * 4 and rows[1][1] == [0] * 16
    small = plan_score_batches(units, micro_batch_size=1, max_micro_batches=1)
    assert len(small) == len(units) and all(len(b.micro_batches) == 1 for b in small)
    with pytest.raises(ValueError):
        plan_score_batches(units, micro_batch_size=0, max_micro_batches=1)


def test_unit_logprobs_and_records():
    u = ScoreUnit("r", (1, 2, 3, 4, 5), 3, 0)  # scores tokens 4 and 5: next-token positions 2 and 3
    assert unit_logprobs(u, [-1.0, -2.0, -3.0, -4.0, -9.0]) == [-3.0, -4.0]
    row = RowScores("r", 3, 2, {0: [-3.0, -4.0], 1: [-0.5]})
    rec = score_record(row, "g")
    assert rec["choice"] == 1 and rec["continuations"][0] == {"tokens": 2, "logprob": -7.0, "mean_logprob": -3.5,
                                                               "token_logprobs": [-3.0, -4.0]}
    plain = score_record(RowScores("p", 4, 1, {None: [-1.0, -2.0, -3.0]}), "g", keep_token_logprobs=False)
    assert plain == {"id": "p", "gear_id": "g", "prompt_tokens": 4, "scored_tokens": 3, "logprob": -6.0,
                     "mean_logprob": -2.0}


def test_gear_parts_place_embedding_and_head():
    assert gear_parts([(0, 4), (4, 30)]) == [0, 5, 32]
    assert gear_parts([(0, 10), (10, 20), (20, 30)]) == [0, 11, 21, 32]
    assert gear_parts([(0, 30)]) == [0, 32]


@pytest.mark.slow
def test_deepspeed_pipeline_scores_equal_transformers_logprobs_on_an_uneven_two_stage_split(tmp_path):
    """Two DeepSpeed ranks, stage 0 = embedding + layers 0-3, stage 1 = layers 4-29 + head; a stage
    failure keeps finished rows and names the stage, and the re-run scores only the rest.

    On a cold ``~/.cache/torch_extensions`` DeepSpeed first JIT-compiles its shm comm op (40-60 s,
    more on a loaded host); warm, the test takes about 25 s, mostly two process start-ups.
    """
    pytest.importorskip("deepspeed")
    from flexpipe_dag.runtime.batch import JsonlSink, PromptRow
    from flexpipe_dag.runtime.model_loader import stage_param_bytes
    from flexpipe_dag.runtime.score_runtime import ScoreOptions, run_score_job
    from tests.test_runtime_helpers import checkpoint, gear, hf_token_logprobs

    ck = checkpoint()
    tok = ck.tokenizer()
    rows = [PromptRow("short", "The capital of France is Paris."),
            PromptRow("long", "Once upon a time, in a small village by the sea, there lived an old fisherman "
                              "who told stories to anyone who would listen."),
            PromptRow("ids", token_ids=[1, 504, 3458, 314, 260, 2837]),
            PromptRow("mc", "The colour of a clear sky at noon is",
                      continuations=[" blue.", " made of green cheese.", " red"]),
            PromptRow("one", token_ids=[42])]  # nothing to score: reported, not fatal
    g = gear([(0, 4), (4, 30)])
    # first run: stage 1 raises before its second batch (the longest unit, row "long", went first)
    faulty = run_score_job(g, rows, JsonlSink(tmp_path / "scores.jsonl"), model=ck,
                           options=ScoreOptions(micro_batch_size=2, max_micro_batches=2,
                                                fault={"stage": 1, "raise_after_batches": 1}))
    assert faulty.failure is not None and faulty.failure.startswith("stage 1 failed: RuntimeError: injected fault")
    assert faulty.finished == 1 and JsonlSink(tmp_path / "scores.jsonl").done_ids() == {"long"}
    # re-run: only the missing rows are scored
    sink = JsonlSink(tmp_path / "scores.jsonl")
    report = run_score_job(g, rows, sink, model=ck, options=ScoreOptions(micro_batch_size=2, max_micro_batches=2))
    assert report.failure is None, report.failure
    assert report.skipped_done == 1 and report.finished == 3
    assert len(report.malformed) == 1 and "'one'" in report.malformed[0].reason
    assert [i["pipe_layers"] for i in report.stage_info] == [[0, 5], [5, 32]]
    assert report.stage_info[0]["param_bytes"] == stage_param_bytes(ck, 0, 4, first=True, last=False)

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    prompt_seqs = [ids(rows[0].prompt), ids(rows[1].prompt), rows[2].token_ids]
    mc = ids(rows[3].prompt)
    mc_seqs = [mc + ids(c) for c in rows[3].continuations]
    ref = hf_token_logprobs(prompt_seqs + mc_seqs)
    got = {r["id"]: r for r in (json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines())}
    for rid, expected in zip(["short", "long", "ids"], ref[:3]):
        assert got[rid]["token_logprobs"] == pytest.approx(expected, abs=1e-4), rid
        assert got[rid]["logprob"] == pytest.approx(sum(expected), abs=2e-3)
    ref_mc = [r[len(mc) - 1:] for r in ref[3:]]
    for c, expected in zip(got["mc"]["continuations"], ref_mc):
        assert c["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert got["mc"]["choice"] == max(range(3), key=lambda i: sum(ref_mc[i]))

    again = run_score_job(g, rows, sink, model=ck)  # idempotent: nothing left to launch
    assert again.skipped_done == 4 and again.submitted == 0 and again.stage_info == []


def test_cli_score_refuses_a_replicated_gear_and_skips_done_rows(tmp_path, capsys):
    pytest.importorskip("torch")
    from flexpipe_dag.cli import main
    from tests.test_runtime_helpers import checkpoint, gear

    gear_path, rows, out = tmp_path / "gear.json", tmp_path / "rows.jsonl", tmp_path / "scores.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "Hello there"}) + "\n")
    argv = ["run", "--score", "--gear", str(gear_path), "--prompts", str(rows), "--out", str(out),
            "--model", str(checkpoint().path)]
    gear_path.write_text(gear([(0, 4), (4, 30)], device_ids=[["cpu0"], ["cpu1", "cpu2"]]).model_dump_json())
    assert main(argv) == 2
    assert "stage 1 has 2 replicas" in capsys.readouterr().err
    gear_path.write_text(gear([(0, 4), (4, 30)]).model_dump_json())
    out.write_text(json.dumps({"id": "a", "gear_id": "earlier", "logprob": -1.0}) + "\n")  # already scored: nothing launches
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["skipped_done"] == 1 and summary["finished"] == 0 and summary["failure"] is None
