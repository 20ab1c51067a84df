"""Bad input across the command line and the store: one clear line, non-zero exit, nothing lost or half-written."""

from __future__ import annotations

import json

import pytest

from flexpipe_dag.cli import main as cli_main
from flexpipe_dag.core.errors import InputError

from conftest import EXAMPLES


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


def test_non_utf8_cluster_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    assert cli_main(["profile", "--cluster", str(bad)]) == 2
    _one_line_error(capsys, str(bad), "not UTF-8")


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


@pytest.mark.parametrize("flags, needle", [
    (["--out", "{tmp}"], "is a directory"),
    (["--out", "{tmp}/missing/dir/out.jsonl"], "does not exist"),
    (["--micro-batch-size", "0"], "--micro-batch-size"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--dtype", "fp7"], "unknown dtype 'fp7'"),
    (["--step-timeout-s", "-1"], "--step-timeout-s"),
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


def test_out_of_vocabulary_token_ids_are_a_malformed_row_not_a_crash():
    from flexpipe_dag.runtime.batch import PromptRow, to_requests
    from test_runtime_helpers import checkpoint

    ckpt = checkpoint()
    tok = ckpt.tokenizer()
    malformed = []
    reqs = to_requests([PromptRow("good", token_ids=[1, 2, 3]), PromptRow("oov", token_ids=[5, 999_999_999])],
                       tok, ckpt.eos_token_ids(), malformed)
    assert [r.request_id for r in reqs] == ["good"]
    assert len(malformed) == 1 and "vocabulary" in malformed[0].reason and "'oov'" in malformed[0].reason


def test_control_file_sections_must_be_mappings(tmp_path):
    from resources.control import ControlSettings

    bad = tmp_path / "c.yaml"
    bad.write_text("controller: [1, 2]\n")
    with pytest.raises(InputError, match="controller: expected a mapping"):
        ControlSettings(config_file=str(bad)).controller_config()
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(InputError, match="cannot read controller config"):
        ControlSettings(config_file=str(bad)).tide_config()
