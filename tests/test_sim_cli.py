"""``flexpipe simulate`` with a hand-written gear and a measured timing table."""

from __future__ import annotations

import json

import pandas as pd

from flexpipe_dag.cli import main
from flexpipe_dag.sim import LinearStageTiming, manual_gear
from flexpipe_dag.workload import load_trace, time_window


def _files(tmp_path):
    gear = manual_gear([15, 15], gear_id="hand-2", micro_batch_size=16, max_inflight_micro_batches=2, kv_capacity_tokens=100_000)
    gear_path = tmp_path / "gear.json"
    gear_path.write_text(gear.model_dump_json())
    timing_path = tmp_path / "stages.csv"
    LinearStageTiming.uniform(2, prefill_fixed_ms=2, prefill_per_token_ms=0.02, decode_fixed_ms=6,
                              decode_per_seq_ms=0.1, transfer_fixed_ms=0.3).to_frame().to_csv(timing_path, index=False)
    return gear_path, timing_path


def test_simulate_json_on_bundled_trace(tmp_path, capsys):
    gear_path, timing_path = _files(tmp_path)
    ts = tmp_path / "ts.csv"
    rc = main(["simulate", "--gear-file", str(gear_path), "--timing", str(timing_path), "--trace", "azure-conv",
               "--window-s", "0", "120", "--speedup", "2", "--offline", "arxiv-summarization", "--offline-limit", "5",
               "--timeseries-csv", str(ts), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gear_id"] == "hand-2" and out["unfinished"] == 0
    assert out["by_class"]["offline"]["requests"] == 5
    assert out["completed"] == out["workload_requests"]
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert set(out[key]) == {"mean", "p50", "p95", "p99"}
    assert len(out["stage_utilisation"]["hand-2"]) == 2
    frame = pd.read_csv(ts)
    assert {"t_s", "queue_length", "kv_used_fraction", "stage1_busy"} <= set(frame.columns)


def test_simulate_text_report(tmp_path, capsys):
    gear_path, timing_path = _files(tmp_path)
    assert main(["simulate", "--gear-file", str(gear_path), "--timing", str(timing_path), "--trace", "azure-code",
                 "--window-s", "0", "60"]) == 0
    text = capsys.readouterr().out
    assert "TTFT ms" in text and "goodput" in text and "stage utilisation [hand-2]" in text


def test_simulate_bad_inputs_exit_2(tmp_path, capsys):
    gear_path, timing_path = _files(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gear_id": "x", "kind": "manual", "model_name": "m", "num_layers": 4, "stages": []}))
    assert main(["simulate", "--gear-file", str(bad), "--timing", str(timing_path), "--trace", "azure-conv"]) == 2
    assert "bad.json: stages" in capsys.readouterr().err
    assert main(["simulate", "--gear-file", str(gear_path), "--timing", str(timing_path), "--trace", "nope.csv"]) == 2
    assert "nope.csv" in capsys.readouterr().err
    assert main(["simulate", "--trace", "azure-conv"]) == 2
    assert "--cluster" in capsys.readouterr().err
    partial = tmp_path / "partial.csv"  # a cost left out would be priced at 0 ms without a word
    partial.write_text("stage_index,prefill_fixed_ms\n0,2\n1,2\n")
    assert main(["simulate", "--gear-file", str(gear_path), "--timing", str(partial), "--trace", "azure-conv"]) == 2
    assert "partial.csv: prefill_per_token_ms: missing column(s) ['prefill_per_token_ms'," in capsys.readouterr().err


def test_simulate_with_planner_gear(capsys, monkeypatch):
    import importlib.util
    from pathlib import Path

    import pytest

    if importlib.util.find_spec("flexpipe_dag.planner.gears") is None:
        pytest.skip("planner not in this checkout")
    cluster = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "fragmented_lab.yaml"
    monkeypatch.setenv("FLEXPIPE_REFERENCE_REQUESTS", "60")  # simulate plans as `plan` does; a quick plan
    rc = main(["simulate", "--cluster", str(cluster), "--model", "Llama-2-7B", "--gear", "throughput",
               "--trace", "azure-conv", "--window-s", "0", "60", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    # Llama-2-7B holds 4,096 tokens: the conversations longer than that are rejected, and counted
    trace = time_window(load_trace("azure-conv"), 0, 60)
    over = sum(r.input_tokens + r.output_tokens > 4096 for r in trace)
    assert over > 0 and out["rejected_context"] == over and out["context"]["over_context"] == over
    assert out["gear_id"].startswith("throughput") and out["completed"] + over == out["workload_requests"]
    assert main(["simulate", "--cluster", str(cluster), "--model", "Llama-2-7B", "--gear", "turbo", "--trace", "azure-conv"]) == 2
    assert "--gear" in capsys.readouterr().err


def test_simulate_chunked_prefill_flag(tmp_path, capsys):
    """Azure code's long prompts (median ~1,900 tokens) at twice their pace: chunks of 256 tokens trade
    the long prompts' TTFT for the decodes' TPOT, and every request still completes."""
    gear_path, timing_path = _files(tmp_path)
    base = ["simulate", "--gear-file", str(gear_path), "--timing", str(timing_path), "--trace", "azure-code",
            "--window-s", "0", "300", "--speedup", "2", "--json"]
    outs = []
    for extra in ([], ["--chunked-prefill-tokens", "256"]):
        assert main(base + extra) == 0
        outs.append(json.loads(capsys.readouterr().out))
    whole, chunked = outs
    assert whole["completed"] == chunked["completed"] == whole["workload_requests"]
    assert chunked["tpot_ms"]["p99"] < whole["tpot_ms"]["p99"]
    assert chunked["ttft_ms"]["p50"] > whole["ttft_ms"]["p50"]
    assert main(base + ["--chunked-prefill-tokens", "0"]) == 2
    assert "--chunked-prefill-tokens: expected 1..1048576 tokens per micro-batch, got 0" in capsys.readouterr().err
    assert main(["simulate", "--day", "--cluster", "x.yaml", "--model", "m", "--chunked-prefill-tokens", "64"]) == 2
    assert "--chunked-prefill-tokens: is for a single-gear replay" in capsys.readouterr().err


def test_an_unsorted_trace_is_one_warning_line_not_python_s_source_listing(tmp_path, capsys):
    gear_path, timing_path = _files(tmp_path)
    trace = tmp_path / "u.csv"
    trace.write_text("request_id,arrival_s,input_tokens,output_tokens\nr1,5,10,10\nr2,1,10,10\n")
    assert main(["simulate", "--gear-file", str(gear_path), "--timing", str(timing_path), "--trace", str(trace)]) == 0
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "warning" in line.lower()]
    assert err == [f"flexpipe simulate: warning: {trace}: 1 row arrives before the row above it; sorted by arrival_s"]


def test_a_timing_table_with_the_wrong_number_of_stages_is_named_by_its_file(tmp_path, capsys):
    gear_path, _ = _files(tmp_path)
    one_row = tmp_path / "one.csv"
    LinearStageTiming.uniform(1, decode_fixed_ms=6).to_frame().to_csv(one_row, index=False)
    assert main(["simulate", "--gear-file", str(gear_path), "--timing", str(one_row), "--trace", "azure-conv"]) == 2
    err = capsys.readouterr().err
    assert f"{one_row}: stages: 1 row(s); expected one per stage of {gear_path} (2)" in err
