"""The context rule (issue 13, item 9): requests whose prompt + output exceed the model's max context are
refused (or, asked to, truncated) and counted, the same way in the simulator, the planner's workload
statistics and ``flexpipe simulate`` (the runtime's side is in test_runtime_context.py)."""

from __future__ import annotations

import json

import pytest

from flexpipe_dag.cli import main
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.planner.model_spec import load_model_spec
from flexpipe_dag.planner.workload import plan_workload_from_trace
from flexpipe_dag.sim import LinearStageTiming, SimConfig, manual_gear, simulate
from flexpipe_dag.workload import Request, Workload, apply_context_rule, fit_to_context, load_trace, time_window
from tests.support import EXAMPLES

LLAMA3_CONTEXT = 8192


def _workload() -> Workload:
    """Ten requests, three of them over Llama-3-8B's 8,192 tokens (one only by its output)."""
    lengths = [(500, 100), (9000, 50), (8000, 100), (8100, 92), (8100, 93), (100, 9000), (2000, 200), (7000, 1000),
               (300, 30), (4000, 4000)]
    return Workload.from_requests([Request(f"r{i}", i * 0.5, p, o) for i, (p, o) in enumerate(lengths)], name="ctx")


def _gear_and_timing():
    gear = manual_gear([16, 16], gear_id="ctx-2", model_name="Llama-3-8B", micro_batch_size=8,
                       max_inflight_micro_batches=2, kv_capacity_tokens=200_000)
    timing = LinearStageTiming.uniform(2, prefill_fixed_ms=2, prefill_per_token_ms=0.02, decode_fixed_ms=6,
                                       decode_per_seq_ms=0.1, transfer_fixed_ms=0.3)
    return gear, timing


OVER = {"r1", "r4", "r5"}  # 9050, 8193 and 9100 tokens


def test_llama3_context_is_8192():
    assert load_model_spec("Llama-3-8B").max_context_tokens == LLAMA3_CONTEXT


def test_fit_to_context_keeps_the_latest_prompt_tokens_and_caps_output_only_when_it_alone_is_too_long():
    assert fit_to_context(100, 10, 8192) == (100, 10)
    assert fit_to_context(9000, 50, 8192) == (8142, 50)
    assert fit_to_context(100, 9000, 8192) == (1, 8191)
    assert fit_to_context(5, 8192, 8192) == (1, 8191)
    with pytest.raises(InputError, match="max_context_tokens"):
        fit_to_context(5, 5, 1)


def test_apply_context_rule_refuses_or_truncates_and_counts():
    w = _workload()
    refused = apply_context_rule(w, LLAMA3_CONTEXT)
    assert set(refused.report.refused_ids) == OVER and {r.request_id for r in refused.refused} == OVER
    assert (refused.report.over_context, refused.report.refused, refused.report.truncated) == (3, 3, 0)
    assert len(refused.workload) == 7 and refused.report.longest_tokens == 9100
    assert "3 of 10 requests over Llama-3-8B's 8192-token max context" in refused.report.describe("Llama-3-8B")

    cut = apply_context_rule(w, LLAMA3_CONTEXT, "truncate")
    assert (cut.report.over_context, cut.report.refused, cut.report.truncated) == (3, 0, 3)
    assert cut.truncated_ids == OVER and len(cut.workload) == 10
    assert all(r.input_tokens + r.output_tokens <= LLAMA3_CONTEXT and r.input_tokens >= 1 for r in cut.workload)
    by_id = {r.request_id: r for r in cut.workload}
    assert (by_id["r1"].input_tokens, by_id["r1"].output_tokens) == (8142, 50)
    assert (by_id["r5"].input_tokens, by_id["r5"].output_tokens) == (1, 8191)
    assert by_id["r0"] == w.requests[0]  # requests that fit are untouched

    unknown = apply_context_rule(w, None)
    assert unknown.workload is w and unknown.report.over_context == 0
    with pytest.raises(InputError, match="context_policy"):
        apply_context_rule(w, LLAMA3_CONTEXT, "drop")  # type: ignore[arg-type]


def test_simulator_rejects_requests_over_the_model_context_and_serves_the_rest():
    gear, timing = _gear_and_timing()
    cfg = SimConfig(max_context_tokens=load_model_spec("Llama-3-8B").max_context_tokens)
    res = simulate(_workload(), gear, timing, cfg)
    s = res.summary
    assert s["rejected_context"] == 3 and s["rejected"] == 3 and s["completed"] == 7 and s["unfinished"] == 0
    assert s["context"] == {"max_context_tokens": 8192, "policy": "refuse", "requests": 10, "over_context": 3,
                            "refused": 3, "truncated": 0, "longest_tokens": 9100}
    df = res.requests.set_index("request_id")
    assert set(df.index[df["reject_reason"] == "context"]) == OVER
    assert df.loc[sorted(OVER), "finish_s"].isna().all() and df.loc[sorted(OVER), "gear_id"].eq("ctx-2").all()
    assert df.drop(index=sorted(OVER))["finish_s"].notna().all()
    assert s["truncated_context"] == 0 and not df["context_truncated"].any()

    # without a known context nothing is checked (the old behaviour): all ten complete
    assert simulate(_workload(), gear, timing, SimConfig()).summary["completed"] == 10


def test_simulator_truncates_when_asked_and_counts_them():
    gear, timing = _gear_and_timing()
    res = simulate(_workload(), gear, timing, SimConfig(max_context_tokens=LLAMA3_CONTEXT, context_policy="truncate"))
    s = res.summary
    assert s["completed"] == 10 and s["rejected"] == 0 and s["truncated_context"] == 3 and s["rejected_context"] == 0
    df = res.requests.set_index("request_id")
    assert set(df.index[df["context_truncated"]]) == OVER
    assert ((df["input_tokens"] + df["output_tokens"]) <= LLAMA3_CONTEXT).all()
    assert df.loc["r1", "input_tokens"] == 8142


def test_kv_rejections_keep_their_own_reason():
    gear, timing = _gear_and_timing()
    res = simulate(_workload(), gear, timing, SimConfig(max_context_tokens=LLAMA3_CONTEXT, kv_capacity_tokens=8000))
    df = res.requests.set_index("request_id")
    assert set(df.index[df["reject_reason"] == "context"]) == OVER
    assert set(df.index[df["reject_reason"] == "kv_capacity"]) == {"r2", "r3"}  # 8100, 8192 > the 8000-token pool
    assert res.summary["rejected"] == 5 and res.summary["rejected_context"] == 3


def test_sim_config_refuses_a_bad_context_setting():
    with pytest.raises(InputError, match="SimConfig: max_context_tokens"):
        SimConfig(max_context_tokens=1)
    with pytest.raises(InputError, match="SimConfig: context_policy"):
        SimConfig(context_policy="cut")  # type: ignore[arg-type]


def test_simulate_cli_llama3_on_azure_conv_rejects_then_truncates(capsys, monkeypatch):
    monkeypatch.setenv("FLEXPIPE_REFERENCE_REQUESTS", "60")  # simulate --gear KIND plans as `plan` does: quickly
    """What was seen: ``simulate`` completed Azure conversations longer than Llama-3-8B's 8,192 tokens (the
    bundled slice of the trace holds one, at 1,109 s)."""
    trace = time_window(load_trace("azure-conv"), 1080, 1140)
    over = sum(r.input_tokens + r.output_tokens > LLAMA3_CONTEXT for r in trace)
    assert over > 0
    args = ["simulate", "--cluster", str(EXAMPLES / "fragmented_lab.yaml"), "--model", "Llama-3-8B", "--gear", "throughput",
            "--trace", "azure-conv", "--window-s", "1080", "1140", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["rejected_context"] == over and out["completed"] + over == out["workload_requests"]
    assert out["context"]["model"] == "Llama-3-8B" and out["context"]["max_context_tokens"] == LLAMA3_CONTEXT
    assert f"context: {over} of {len(trace)} requests over Llama-3-8B's 8192-token max context" in captured.err
    assert "--truncate-context" in captured.err

    assert main(args + ["--truncate-context"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["truncated_context"] == over and out["rejected_context"] == 0
    assert out["completed"] == out["workload_requests"]

    assert main(args[:-1]) == 0  # the human report says it too
    text = capsys.readouterr().out
    assert f"context: {over} of {len(trace)} requests over" in text and f"({over} over the max context)" in text


def test_simulate_cli_max_context_flag(tmp_path, capsys):
    gear, timing = _gear_and_timing()
    gear_path, timing_path = tmp_path / "gear.json", tmp_path / "stages.csv"
    gear_path.write_text(gear.model_copy(update={"model_name": "my-finetune"}).model_dump_json())
    timing.to_frame().to_csv(timing_path, index=False)
    base = ["simulate", "--gear-file", str(gear_path), "--timing", str(timing_path), "--trace", "azure-conv",
            "--window-s", "0", "30", "--json"]
    assert main(base) == 0  # an unknown model: not checked, and the user is told so
    captured = capsys.readouterr()
    assert json.loads(captured.out)["rejected_context"] == 0
    assert "my-finetune's max context is not known" in captured.err and "--max-context-tokens" in captured.err

    trace = time_window(load_trace("azure-conv"), 0, 30)
    assert main(base + ["--max-context-tokens", "2048"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rejected_context"] == sum(r.input_tokens + r.output_tokens > 2048 for r in trace) > 0

    assert main(base + ["--max-context-tokens", "1"]) == 2
    assert "--max-context-tokens" in capsys.readouterr().err
    assert main(base + ["--model", "Llama-2-7B", "--max-context-tokens", "8192"]) == 2  # above the model's own
    err = capsys.readouterr().err
    assert "--max-context-tokens" in err and "4096" in err


def test_planner_workload_stats_leave_out_or_truncate_requests_over_the_context():
    w = _workload()
    fit = [r for r in w if r.request_id not in OVER]
    plan, report = plan_workload_from_trace(w, max_context_tokens=LLAMA3_CONTEXT)
    assert report.over_context == 3 and report.refused == 3
    assert plan.prompt_tokens_mean == int(sum(r.input_tokens for r in fit) / len(fit))
    assert plan.output_tokens_mean == int(sum(r.output_tokens for r in fit) / len(fit))
    assert plan.context_p95_tokens <= LLAMA3_CONTEXT

    cut, report = plan_workload_from_trace(w, max_context_tokens=LLAMA3_CONTEXT, context_policy="truncate",
                                           context_p95_cap_tokens=4096)
    assert report.truncated == 3 and cut.context_p95_tokens == 4096
    truncated = apply_context_rule(w, LLAMA3_CONTEXT, "truncate").workload
    assert cut.prompt_tokens_mean == int(sum(r.input_tokens for r in truncated) / 10)

    raw, report = plan_workload_from_trace(w, max_context_tokens=None)  # unknown context: every request counts
    assert report.over_context == 0 and raw.prompt_tokens_mean == int(sum(r.input_tokens for r in w) / 10)
    with pytest.raises(InputError, match="exceed the max context of 100 tokens"):
        plan_workload_from_trace(w, max_context_tokens=100)


def test_planning_settings_apply_the_models_context_to_the_reference_trace():
    pytest.importorskip("dagster")
    from flexpipe_dag.resources.planning import PlanningSettings

    trace = load_trace("azure-conv")
    over = sum(r.input_tokens + r.output_tokens > LLAMA3_CONTEXT for r in trace)
    settings = PlanningSettings(model="Llama-3-8B")
    plan, report = settings.plan_workload_and_context()
    assert report.over_context == report.refused == over > 0 and report.max_context_tokens == LLAMA3_CONTEXT
    ref = settings.reference_workload()
    assert len(ref) == len(trace) - over and max(r.input_tokens + r.output_tokens for r in ref) <= LLAMA3_CONTEXT
    _, report = PlanningSettings(model="Llama-3-8B", context_policy="truncate").plan_workload_and_context()
    assert report.truncated == over
    with pytest.raises(InputError, match="context_policy"):
        PlanningSettings(model="Llama-3-8B", context_policy="drop").plan_workload()
