"""Bad input across the command line and the store: one clear line, non-zero exit, nothing lost or half-written."""

from __future__ import annotations

import json

import pytest

from flexpipe_dag.cli import main as cli_main
from flexpipe_dag.core.errors import InputError
from tests.support import EXAMPLES


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--cluster", "x.yaml", "--slo-ttft-ms", "abc"], "argument --slo-ttft-ms: invalid float value: 'abc'"),
    (["store", "nope"], "invalid choice: 'nope'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_a_flag_argparse_refuses_gets_one_line_not_a_usage_block(argv, needle, capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(argv)
    assert stop.value.code == 2
    err = _one_line_error(capsys, needle, "--help")
    assert not err.startswith("usage")


def test_plan_on_a_trace_of_three_requests_is_refused_not_promised(tmp_path, capsys):
    # the trial's case: 3 requests gave an envelope of 75,209 req/s "measured by the simulator"
    trace = tmp_path / "tiny3.csv"
    trace.write_text("request_id,arrival_s,input_tokens,output_tokens\na,0,10,5\nb,1,20,5\nc,2,30,5\n")
    assert cli_main(["plan", "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", "Llama-3-8B",
                     "--trace", str(trace), "--requests", "300"]) == 2
    _one_line_error(capsys, "tiny3.csv", "3 request(s)", "at least 50")


def test_plan_says_when_the_trace_is_shorter_than_the_requests_asked_for(tmp_path, capsys):
    trace = tmp_path / "short80.csv"
    trace.write_text("request_id,arrival_s,input_tokens,output_tokens\n"
                     + "".join(f"r{i},{i * 0.5},{100 + i},20\n" for i in range(80)))
    assert cli_main(["plan", "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", "Llama-3-8B",
                     "--trace", str(trace), "--requests", "300", "--load-rps", "1e7"]) == 1  # none holds 1e7 req/s
    out, err = capsys.readouterr()
    assert "the trace has 80 requests" in out and "not the 300 asked for" in out
    assert "dtype" in out and "bf16 requested" in out
    assert "* recommended" not in out and "no gear holds" in out  # none is marked
    assert err.startswith("flexpipe plan: infeasible: no gear holds 1e+07 req/s: the largest envelope")
    assert err.count("no gear holds") == 1  # it was said twice


def test_plan_with_an_slo_no_gear_meets_exits_1_and_says_so(capsys):
    """Was exit 0, with a gear of envelope 0 in the table and in --json's gears, the reason only in a note."""
    argv = ["plan", "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", "SmolLM2-135M", "--requests", "60",
            "--slo-tpot-ms", "0.001"]
    assert cli_main([*argv, "--json"]) == 1
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["feasible"] is False and all(g["rps_max"] == 0 for g in doc["gears"])
    assert "flexpipe plan: infeasible: no gear meets the SLO" in err and "at any load" in err
    assert cli_main(argv) == 1
    assert "infeasible: no gear meets the SLO" in capsys.readouterr().err


def test_non_utf8_cluster_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    assert cli_main(["profile", "--cluster", str(bad)]) == 2
    _one_line_error(capsys, str(bad), "not UTF-8")


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_empty_cluster_and_price_files_say_so(text, tmp_path, capsys):
    # an empty file was refused as "expected a mapping at the top level, got NoneType"
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    assert cli_main(["profile", "--cluster", str(empty), "--no-store"]) == 2
    err = _one_line_error(capsys, str(empty), "the file holds no document; expected a mapping with 'devices'")
    assert "NoneType" not in err
    assert cli_main(["capacity", "--model", "Llama-3-8B", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100",
                     "--load-rps", "1", "--price-file", str(empty)]) == 2
    err = _one_line_error(capsys, str(empty), "the file holds no document; expected a mapping with per_gpu_hour")
    assert "NoneType" not in err


def test_printed_json_loads_back(tmp_path, capsys):
    assert cli_main(["profile", "--cluster", str(EXAMPLES / "seed_example.yaml"), "--json"]) == 0
    out = tmp_path / "printed.json"
    out.write_text(capsys.readouterr().out)
    assert cli_main(["profile", "--cluster", str(out), "--no-store"]) == 0


@pytest.mark.parametrize("url, needle", [
    ("not-a-url", "is not a database URL"),
    ("postgresql+psycopg2://nobody@127.0.0.1:1/x", "cannot open the store"),
    ("mysql://a@b/c", "no driver"),
])
def test_bad_database_url_is_one_line(url, needle, monkeypatch, capsys):
    monkeypatch.setenv("FLEXPIPE_DATABASE_URL", url)
    assert cli_main(["profile", "--cluster", str(EXAMPLES / "seed_example.yaml")]) == 2
    _one_line_error(capsys, "FLEXPIPE_DATABASE_URL", needle)


def test_run_refuses_split_with_a_gear(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    assert cli_main(["run", "--gear", "g1", "--split", "even", "--prompts", str(prompts)]) == 2
    _one_line_error(capsys, "--split: splits the layers of a --stages run; gear 'g1' has its own stages")


@pytest.mark.parametrize("flags, needle", [
    (["--out", "{tmp}"], "is a directory"),
    (["--out", "{tmp}/missing/dir/out.jsonl"], "does not exist"),
    (["--micro-batch-size", "0"], "--micro-batch-size"),
    (["--micro-batch-size", "70000"], "--micro-batch-size: expected an integer 1..65536, got 70000"),
    (["--inflight", "5000"], "--inflight: expected an integer 1..4096, got 5000"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--max-new-tokens", str(10**20)], "--max-new-tokens: expected an integer 1..2147483647, got 1000"),
    (["--dtype", "fp7"], "unknown dtype 'fp7'"),
    (["--step-timeout-s", "-1"], "--step-timeout-s"),
    (["--chunked-prefill-tokens", "0"], "expected 1..1048576 tokens per micro-batch, got 0"),
    (["--chunked-prefill-tokens", "64", "--score"], "is for generation"),
])
def test_run_refuses_bad_flags_before_launch(flags, needle, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert cli_main(["run", "--stages", "2", "--prompts", str(prompts), *flags]) == 2
    _one_line_error(capsys, needle)


def test_non_utf8_results_file_fails_before_launch(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"\xff\xfe\x00")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    assert cli_main(["run", "--stages", "2", "--prompts", str(prompts), "--out", str(out)]) == 2
    _one_line_error(capsys, "--out")


def test_prompt_rows_with_infinite_numbers_or_string_ids_are_malformed(tmp_path):
    from flexpipe_dag.runtime.batch import read_prompts

    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps(r) if not isinstance(r, str) else r for r in [
        {"id": "ok", "prompt": "hi"}, '{"id": "inf", "prompt": "hi", "max_new_tokens": Infinity}',
        '{"id": "pinf", "prompt": "hi", "priority": Infinity}', {"id": "s", "token_ids": "123"}]) + "\n")
    rows, bad = read_prompts(p)
    assert [r.request_id for r in rows] == ["ok"]
    assert len(bad) == 3 and any("max_new_tokens" in b.reason for b in bad)


def test_a_prompt_that_is_not_unicode_text_is_a_malformed_row_not_a_tokenizer_crash(tmp_path):
    """A lone UTF-16 surrogate (JSON's escapes allow it, UTF-8 cannot encode it) made the tokenizer raise
    mid-run, after the model loaded, and no row was served; now the row is listed and skipped."""
    from flexpipe_dag.runtime.batch import read_prompts

    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "ok", "prompt": "hi"}\n{"id": "x9", "prompt": "\\ud800 surrogate"}\n'
                 '{"id": "c", "prompt": "hi", "continuations": ["a", "\\udc00"]}\n')
    rows, bad = read_prompts(p)
    assert [r.request_id for r in rows] == ["ok"]
    assert {b.line: b.reason for b in bad} == {
        2: "field 'prompt': holds a lone UTF-16 surrogate (e.g. \\ud800), which is not Unicode text; expected valid "
           "UTF-8 text",
        3: "field 'continuations.1': holds a lone UTF-16 surrogate (e.g. \\ud800), which is not Unicode text; expected "
           "valid UTF-8 text"}


def test_prompt_rows_hold_documented_ids_numbers_not_strings_and_one_prompt(tmp_path):
    from flexpipe_dag.core.settings import INT32_MAX
    from flexpipe_dag.runtime.batch import read_prompts

    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"id": "ok-1", "prompt": "hi", "max_new_tokens": 4}, {"id": 7, "token_ids": [1, 2]},
        {"id": "bad id with space", "prompt": "hi"}, {"id": "s", "prompt": "hi", "max_new_tokens": "4"},
        {"id": "p", "priority": "1", "prompt": "hi"}, {"id": "both", "prompt": "hi", "token_ids": [1, 2]},
        {"id": "f", "prompt": "hi", "max_new_tokens": 3.0}, {"id": "e", "prompt": "hi", "max_new_tokens": 1e3},
        {"id": "t", "token_ids": [1, 2.0]}]) + "\n" + '{"id": "n", "prompt": "hi", "max_new_tokens": NaN}\n'
        + '{"id": NaN, "prompt": "hi"}\n{"id": "i", "prompt": "hi", "priority": -Infinity}\n')
    rows, bad = read_prompts(p)
    assert [r.request_id for r in rows] == ["ok-1"]  # types are JSON's, strictly: nothing is converted
    reasons = {b.line: b.reason for b in bad}
    assert reasons[2] == "field 'id': expected a string, got 7"
    assert "holds ' ' at character 4" in reasons[3]
    assert "max_new_tokens': expected an integer" in reasons[4] and "priority': expected an integer" in reasons[5]
    assert reasons[6] == "both 'prompt' and 'token_ids'; expected one of them"
    assert reasons[7].endswith("got 3.0") and reasons[8].endswith("got 1000.0") and "token_ids" in reasons[9]
    assert reasons[10] == f"field 'max_new_tokens': expected an integer 1..{INT32_MAX}, got NaN"  # not the default
    assert reasons[11] == "field 'id': expected a string, got NaN" and reasons[12].endswith("got -Infinity")


def test_out_of_vocabulary_token_ids_are_a_malformed_row_not_a_crash():
    from flexpipe_dag.runtime.batch import PromptRow, to_requests
    from tests.test_runtime_helpers import checkpoint

    ckpt = checkpoint()
    tok = ckpt.tokenizer()
    malformed = []
    reqs = to_requests([PromptRow("good", token_ids=[1, 2, 3]), PromptRow("oov", token_ids=[5, 999_999_999])],
                       tok, ckpt.eos_token_ids(), malformed)
    assert [r.request_id for r in reqs] == ["good"]
    assert len(malformed) == 1 and "vocabulary" in malformed[0].reason and "'oov'" in malformed[0].reason


def test_a_prompts_file_of_only_out_of_vocabulary_ids_is_refused_before_any_worker_starts(tmp_path, capsys, monkeypatch):
    import flexpipe_dag.runtime.pipeline as pipeline

    def no_runtime(*args, **kwargs):
        raise AssertionError("a stage worker was started for a file with no valid row")

    monkeypatch.setattr(pipeline, "PipelineRuntime", no_runtime)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "token_ids": [99999999]}\n{"id": "b", "token_ids": [1, 49152]}\n')
    assert cli_main(["run", "--stages", "1", "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "no valid request (2 malformed row(s), listed above)" in err
    assert "row 1: id 'a': field 'token_ids': id 99999999 is outside the model's vocabulary (0..49151)" in err
    assert not (tmp_path / "o.jsonl").exists() or not (tmp_path / "o.jsonl").read_text()


def test_control_file_sections_must_be_mappings(tmp_path):
    from flexpipe_dag.resources.control import ControlSettings

    bad = tmp_path / "c.yaml"
    bad.write_text("controller: [1, 2]\n")
    with pytest.raises(InputError, match="controller: expected a mapping"):
        ControlSettings(config_file=str(bad)).controller_config()
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(InputError, match="cannot read controller config"):
        ControlSettings(config_file=str(bad)).tide_config()


# -- integers too large for the store, at the input boundary ------------------------------------
def test_prompt_rows_with_integers_too_large_for_the_store_are_malformed(tmp_path):
    from flexpipe_dag.core.settings import INT32_MAX
    from flexpipe_dag.runtime.batch import read_prompts

    big = 10**30
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"id": "ok", "prompt": "hi", "max_new_tokens": INT32_MAX, "priority": INT32_MAX},
        {"id": "mnt", "prompt": "hi", "max_new_tokens": big}, {"id": "prio", "prompt": "hi", "priority": big},
        {"id": "tok", "token_ids": [1, big]}, {"id": "frac", "token_ids": [1, 2.5]},
        {"id": "x" * 201, "prompt": "hi"}, {"id": "cont", "prompt": "hi", "continuations": [[big]]},
        {"id": big, "prompt": "a numeric id is refused: ids are strings"}]) + "\n")
    rows, bad = read_prompts(p)
    assert [r.request_id for r in rows] == ["ok"]
    reasons = {b.line: b.reason for b in bad}
    assert f"'max_new_tokens': expected an integer 1..{INT32_MAX}, got {big}" in reasons[2]
    assert f"'priority': expected an integer 0..{INT32_MAX}" in reasons[3]
    assert "'token_ids'" in reasons[4] and "'token_ids'" in reasons[5]
    assert "'id': 201 characters; expected at most 200" in reasons[6]
    assert "'continuations'" in reasons[7] and reasons[8].startswith("field 'id': expected a string")


def test_prompts_with_huge_numbers_run_nothing_and_exit_2(tmp_path, capsys):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "a", "prompt": "hi", "max_new_tokens": 10**30}) + "\n")
    out = tmp_path / "out.jsonl"
    assert cli_main(["run", "--stages", "2", "--prompts", str(p), "--out", str(out)]) == 2
    assert "max_new_tokens" in capsys.readouterr().err
    assert not out.exists() or out.read_text() == ""


@pytest.mark.parametrize("text, field, needle", [
    ("arrival_s,input_tokens,output_tokens\n0,1e30,4\n", "row 1.input_tokens", "<= 2147483647"),
    ("arrival_s,input_tokens,output_tokens,priority\n0,3,4,1e30\n", "row 1.priority", "-2147483647..2147483647"),
    ("request_id,arrival_s,input_tokens,output_tokens\n" + "r" * 201 + ",0,3,4\n", "row 1.request_id",
     "expected at most 200"),
    # integers too large for a float: pandas reads them as Python ints and its to_numeric raised OverflowError
    ("arrival_s,input_tokens,output_tokens\n0,3,1" + "0" * 400 + "\n", "row 1.output_tokens", "<= 2147483647"),
    ("arrival_s,input_tokens,output_tokens\n0,3,4\n1" + "0" * 400 + ",3,4\n", "row 2.arrival_s", "(31 days)"),
    ("arrival_s,input_tokens,output_tokens,priority\n0,3,4,-1" + "0" * 400 + "\n", "row 1.priority",
     "-2147483647..2147483647"),
])
def test_trace_files_with_out_of_range_integers(tmp_path, text, field, needle):
    from flexpipe_dag.workload.loaders import load_request_file

    p = tmp_path / "t.csv"
    p.write_text(text)
    with pytest.raises(InputError) as e:
        load_request_file(p)
    assert e.value.source == str(p) and e.value.field == field and needle in e.value.problem


def test_length_file_bad_arguments_name_the_field(tmp_path):
    from flexpipe_dag.workload.loaders import load_length_file

    p = tmp_path / "len.csv"
    p.write_text("num_prefill_tokens,num_decode_tokens\n10,5\n99999999999999999999,5\n")
    with pytest.raises(InputError, match="limit: expected an integer >= 1"):
        load_length_file(p, limit=0)
    with pytest.raises(InputError, match="priority: expected an integer"):
        load_length_file(p, priority=10**30)
    with pytest.raises(InputError, match="arrival_s: expected a finite number >= 0"):
        load_length_file(p, arrival_s=float("nan"))
    with pytest.raises(InputError, match="row 2.num_prefill_tokens"):
        load_length_file(p)
    assert len(load_length_file(p, limit=1)) == 1


# -- model configs ------------------------------------------------------------------------------
_CONFIG = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": 100, "max_position_embeddings": 2048}


@pytest.mark.parametrize("extra, field, needle", [
    ({"num_key_value_heads": 0}, "num_key_value_heads", "expected an integer >= 1"),
    ({"head_dim": 0}, "head_dim", "expected an integer >= 1"),
    ({"num_key_value_heads": "4"}, "num_key_value_heads", "got '4'"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "does not divide num_attention_heads 4"),
    ({"rope_theta": "abc"}, "rope_theta", "expected a finite number > 0, got 'abc'"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps", "expected a finite number > 0"),
    ({"max_position_embeddings": "4k"}, "max_position_embeddings", "got '4k'"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "expected true or false"),
    ({"attention_bias": 1}, "attention_bias", "expected true or false"),
    ({"architectures": "LlamaForCausalLM"}, "architectures", "expected a list of strings"),
    ({"hidden_size": 66}, "head_dim", "not divisible by num_attention_heads"),
    ({"vocab_size": 10**30}, "vocab_size", "<= 4194304"),  # MODEL_COUNT_LIMITS, before anything allocates
])
def test_model_config_bad_fields_are_named(tmp_path, extra, field, needle):
    from flexpipe_dag.planner.model_spec import load_model_spec

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**_CONFIG, **extra}))
    with pytest.raises(InputError) as e:
        load_model_spec(tmp_path)
    assert e.value.source == str(cfg) and e.value.field == field and needle in e.value.problem, str(e.value)


def test_model_config_nulls_mean_unset(tmp_path):
    from flexpipe_dag.planner.model_spec import load_model_spec

    (tmp_path / "config.json").write_text(json.dumps({**_CONFIG, "head_dim": None, "num_key_value_heads": None,
                                                      "rope_theta": 10000.0, "tie_word_embeddings": True}))
    spec = load_model_spec(tmp_path)
    assert spec.head_dim == 16 and spec.num_kv_heads == 4 and spec.tie_word_embeddings


def test_model_config_error_is_one_line_from_the_cli(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**_CONFIG, "num_key_value_heads": 0}))
    assert cli_main(["plan", "--cluster", str(EXAMPLES / "fragmented_lab.yaml"), "--model", str(tmp_path)]) == 2
    _one_line_error(capsys, "config.json: num_key_value_heads", "expected an integer >= 1")


# -- plan and simulate flags --------------------------------------------------------------------
@pytest.mark.parametrize("flags, needle", [
    (["--context-p95", "8192"], "--context-p95: 8192 tokens exceeds Llama-2-7B's max context of 4096"),
    (["--context-p95", "0"], "--context-p95: expected an integer >= 1"),
    (["--concurrency", "0"], "--concurrency: expected an integer >= 1"),
    (["--min-residence-s", "-1"], "--min-residence-s: expected a finite number >= 0"),
    (["--min-residence-s", "nan"], "--min-residence-s: expected a finite number >= 0"),
])
def test_plan_refuses_bad_numbers(flags, needle, capsys):
    assert cli_main(["plan", "--cluster", str(EXAMPLES / "fragmented_lab.yaml"), "--model", "Llama-2-7B",
                     "--json", *flags]) == 2
    _one_line_error(capsys, needle)


def test_plan_context_p95_is_checked_against_the_model_context_only_when_given(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**_CONFIG, "max_position_embeddings": 2048}))
    from flexpipe_dag.cli.plan import check_context_p95
    from flexpipe_dag.planner.model_spec import load_model_spec

    spec = load_model_spec(tmp_path)
    check_context_p95(None, spec)  # unset: the trace's P95 under the context rule, nothing to check
    check_context_p95(2048, spec)
    with pytest.raises(InputError, match=r"--context-p95.*2049 tokens exceeds .*max context of 2048"):
        check_context_p95(2049, spec)


@pytest.fixture
def sim_files(tmp_path):
    from tests.test_sim_cli import _files

    gear, timing = _files(tmp_path)
    return ["simulate", "--gear-file", str(gear), "--timing", str(timing), "--trace", "azure-conv",
            "--window-s", "0", "30", "--json"]


@pytest.mark.parametrize("flags, needle", [
    (["--offline", "arxiv-summarization", "--offline-limit", "-5"], "--offline-limit: expected an integer >= 1"),
    (["--offline", "arxiv-summarization", "--offline-limit", "0"], "--offline-limit: expected an integer >= 1"),
    (["--offline-limit", "3"], "--offline-limit: needs --offline"),
    (["--speedup", "0"], "--speedup: expected a finite number >= 0.001 and <= 1e+06 (factor), got 0"),  # the range
    (["--tide-compression", "0"], "--tide-compression: expected a finite number > 0"),
    (["--slo-ttft-ms", "-1"], "--slo-ttft-ms: expected a finite number > 0"),
    (["--kv-capacity-tokens", "0"], "--kv-capacity-tokens: expected an integer >= 1"),
    (["--micro-batch-size", str(10**30)], "--micro-batch-size: expected an integer >= 1 and <= 2147483647"),
    (["--window-s", "-5", "10"], "--window-s START: expected a finite number >= 0"),
    (["--window-s", "30", "10"], "--window-s END: expected a number > 30"),
    (["--timeseries-csv", "/nonexistent-dir/ts.csv"], "--timeseries-csv: directory /nonexistent-dir does not exist"),
    (["--dtype", "fp7"], "--dtype: unknown dtype 'fp7'"),
])
def test_simulate_refuses_bad_numbers(flags, needle, sim_files, capsys):
    assert cli_main([*sim_files, *flags]) == 2
    _one_line_error(capsys, needle)


def test_simulate_offline_limit_limits(sim_files, capsys):
    assert cli_main([*sim_files, "--offline", "arxiv-summarization", "--offline-limit", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["by_class"]["offline"]["requests"] == 3


@pytest.mark.parametrize(("costs", "what"), [({"decode_fixed_ms": 1e300}, "step"), ({"decode_fixed_ms": 1e8}, "step"),
                                             ({"transfer_fixed_ms": 1e300}, "transfer"),
                                             ({"transfer_per_token_ms": 1e300}, "transfer")])
def test_stage_times_no_pipeline_takes_stop_the_run_naming_the_timing_file(costs, what, tmp_path, capsys):
    """A timing table whose steps take hours or more used to push the sampled clock out without bound (1e300 ms
    ran until memory ran out); the run now stops at the drain horizon, naming the table and the stage."""
    from flexpipe_dag.core.gear_builders import manual_gear
    from flexpipe_dag.sim.timing import LinearStageTiming

    gear_path, timing_path = tmp_path / "gear.json", tmp_path / "huge.csv"
    gear_path.write_text(manual_gear([15, 15], gear_id="hand-2", micro_batch_size=16).model_dump_json())
    LinearStageTiming.uniform(2, **{"prefill_fixed_ms": 2, "prefill_per_token_ms": 0.02, "decode_fixed_ms": 6,
                                    "decode_per_seq_ms": 0.1, "transfer_fixed_ms": 0.3, **costs}
                              ).to_frame().to_csv(timing_path, index=False)
    argv = ["simulate", "--gear-file", str(gear_path), "--timing", str(timing_path), "--trace", "azure-conv",
            "--window-s", "0", "30", "--json"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]   # (above it: the note that the gear has no envelope)
    assert f"error: {timing_path}: stage 0 {what} time: a {what} of " in err and "check the timing's coefficients" in err


@pytest.mark.parametrize("argv, needle", [
    (["servers", "--max-age-s", "1e308"], "--max-age-s: expected a finite number > 0 and <= 3.1536e+07 (s), got 1e+308"),
    (["servers", "--max-age-s", "inf"], "--max-age-s: expected a finite number > 0"),
    (["fleet", "--cluster", str(EXAMPLES / "fleet_small.yaml"), "--model", "Llama-3-8B", "--concurrency", "0"],
     "--concurrency: expected an integer >= 1 and <= 1000000 (sequences), got 0"),
    (["loadtest", "--url", "http://127.0.0.1:9/v1", "--concurrency", "1,20000000"],
     "--concurrency: expected levels 1..10000 (clients, one coroutine each), got '1,20000000'"),
    (["capacity", "--model", "Llama-3-8B", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "200", "--load-rps", "5e-324",
      "--no-simulate", "--json"], "--load-rps: expected a finite number >= 1e-05 and <= 1e+07 (req/s), got 5e-324"),
])
def test_flags_whose_extremes_crashed_are_refused_in_one_line(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXPIPE_HOME", str(tmp_path))
    assert cli_main(argv) == 2
    _one_line_error(capsys, needle)
