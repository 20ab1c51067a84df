"""``flexpipe plan`` end to end: envelopes measured at the user's SLO, a recommendation for a load,
JSON and table output, exit status 2 on infeasible input. Probes use few requests to stay quick."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flexpipe_dag.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
QUICK = ["--requests", "60"]


def _plan(capsys, *args: str) -> dict:
    assert main(["plan", *args, *QUICK, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_gears_ordered_by_measured_envelope(capsys):
    out = _plan(capsys, "--cluster", str(EXAMPLES / "alibaba_openb.yaml"), "--model", "Llama-3-8B")
    kinds = [g["kind"] for g in out["gears"]]
    assert kinds[-1] == "throughput" and kinds == [k for k in ("latency", "balanced", "throughput") if k in kinds]
    envelopes = [g["rps_max"] for g in out["gears"]]
    assert envelopes == sorted(envelopes) and envelopes[-1] > 0  # "throughput" carries the most, by measurement
    assert out["model"]["num_layers"] == 32
    for g in out["gears"]:
        assert g["envelope_basis"] == {"source": "simulator", "slo_ttft_ms": 2000.0, "slo_tpot_ms": 200.0,
                                       "attainment": 0.95, "workload": "azure-conv", "num_requests": 60}
    assert out["recommended"] is None
    # a kind left out says why
    assert len(out["notes"]) >= 3 - len(kinds)


def test_slo_flags_and_environment_set_what_envelopes_are_measured_against(capsys, monkeypatch):
    seed = ["--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", "SmolLM2-135M"]
    loose = _plan(capsys, *seed)
    tight = _plan(capsys, *seed, "--slo-ttft-ms", "300", "--slo-tpot-ms", "3", "--attainment", "0.99")
    assert tight["gears"][0]["envelope_basis"]["slo_tpot_ms"] == 3.0
    assert tight["gears"][0]["envelope_basis"]["attainment"] == 0.99
    assert max(g["rps_max"] for g in tight["gears"]) < max(g["rps_max"] for g in loose["gears"])
    monkeypatch.setenv("FLEXPIPE_SLO_TTFT_MS", "300")
    by_env = _plan(capsys, *seed)
    assert by_env["envelope_basis"]["slo_ttft_ms"] == 300.0


def test_load_marks_one_gear_recommended_with_its_headroom(capsys):
    out = _plan(capsys, "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", "SmolLM2-135M",
                "--load-rps", "5")
    rec = out["recommended"]
    gear = next(g for g in out["gears"] if g["gear_id"] == rec["gear_id"])
    assert rec["holds"] and gear["rps_max"] >= 5
    assert math.isclose(rec["headroom_fraction"], 1 - 5 / gear["rps_max"])
    holding = [g for g in out["gears"] if g["rps_max"] >= 5]
    assert sum(len(s["device_ids"]) for s in gear["stages"]) == min(
        sum(len(s["device_ids"]) for s in g["stages"]) for g in holding)


def test_plan_table_names_the_slo_and_the_recommendation(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    rc = main(["plan", "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", "SmolLM2-135M",
               "--concurrency", "8", "--context-p95", "2048", "--load-rps", "1", *QUICK])
    assert rc == 0
    out = capsys.readouterr().out
    assert "throughput-" in out and "95% within TTFT 2000 ms / TPOT 200 ms on azure-conv" in out
    assert "load 1.00 req/s: run" in out


@pytest.mark.parametrize("flag,value", [("--slo-ttft-ms", "0"), ("--attainment", "1.5"), ("--load-rps", "-1"),
                                        ("--requests", "10"), ("--slo-tpot-ms", "nan")])
def test_bad_planning_flags_are_refused_by_name(capsys, flag, value):
    rc = main(["plan", "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", "SmolLM2-135M", flag, value])
    assert rc == 2
    assert flag in capsys.readouterr().err


def test_plan_infeasible_exits_2(capsys):
    rc = main(["plan", "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", "Llama-2-70B",
               "--concurrency", "512", *QUICK])
    assert rc == 2
    assert "KV pool" in capsys.readouterr().err


def test_a_bad_fallback_in_the_environment_is_one_named_line(capsys, monkeypatch):
    monkeypatch.setenv("FLEXPIPE_BF16_FALLBACK", "xyz")
    assert main(["plan", "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", "SmolLM2-135M"]) == 2
    err = capsys.readouterr().err
    assert "FLEXPIPE_BF16_FALLBACK" in err and "fp16, exclude, refuse" in err and "Traceback" not in err


def test_short_probes_and_loads_beyond_every_envelope_are_said(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    rc = main(["plan", "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", "SmolLM2-135M",
               "--load-rps", "1e300", *QUICK])
    assert rc == 1  # none holds the load: infeasible, said on stderr
    out, err = capsys.readouterr()
    assert err.startswith("flexpipe plan: infeasible: no gear holds 1e+300 req/s")
    assert "no gear holds 1e+300 req/s" in out and "headroom" not in out.split("load 1.0e+300")[-1].split("\n")[0]
    flat = " ".join(out.split())  # the console wraps long notes
    assert "may not represent the trace" in flat and "at least 1000 requests" in flat  # --requests 60


def test_simulate_scores_a_saved_gear_at_the_slo_its_envelope_promises(tmp_path, capsys):
    out = _plan(capsys, "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", "SmolLM2-135M",
                "--slo-ttft-ms", "1500", "--slo-tpot-ms", "150")
    path = tmp_path / "gear.json"
    path.write_text(json.dumps(out["gears"][-1]))
    common = ["--gear-file", str(path), "--cluster", str(EXAMPLES / "seed_example.yaml"), "--trace", "azure-conv",
              "--window-s", "0", "20", "--json"]
    assert main(["simulate", *common]) == 0
    assert json.loads(capsys.readouterr().out)["slo"] == {"ttft_ms": 1500.0, "tpot_ms": 150.0}
    assert main(["simulate", *common[:-1], "--window-s", "99999", "100000"]) == 2
    assert "--window-s" in capsys.readouterr().err


def test_simulate_replays_at_a_rate_set_from_the_windows_own_rate(tmp_path, capsys):
    """``--rate-rps R`` is ``--speedup`` R / the window's own mean rate (checked against the trace read here),
    and the summary grades the requests after the first quarter of arrivals as an envelope probe does."""
    from flexpipe_dag.workload import load_trace
    from flexpipe_dag.workload.transform import time_window

    out = _plan(capsys, "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", "SmolLM2-135M")
    gear = out["gears"][-1]
    path = tmp_path / "gear.json"
    path.write_text(json.dumps(gear))
    common = ["simulate", "--gear-file", str(path), "--cluster", str(EXAMPLES / "seed_example.yaml"), "--trace",
              "azure-conv", "--window-s", "600", "900", "--json"]
    rate = 0.9 * gear["rps_max"]
    assert main([*common, "--rate-rps", str(rate)]) == 0
    by_rate = json.loads(capsys.readouterr().out)
    own = time_window(load_trace("azure-conv"), 600, 900).mean_rate_rps
    assert by_rate["replay"]["trace_rate_rps"] == pytest.approx(own)
    assert by_rate["replay"]["speedup"] == pytest.approx(rate / own)
    assert main([*common, "--speedup", repr(rate / own)]) == 0
    by_speedup = json.loads(capsys.readouterr().out)
    assert {k: by_speedup[k] for k in ("requests", "completed", "slo_attainment", "makespan_s")} == \
        {k: by_rate[k] for k in ("requests", "completed", "slo_attainment", "makespan_s")}
    assert 0.0 <= by_rate["slo_attainment_after_warmup"] <= 1.0
    for flags, said in ((["--rate-rps", "0"], "--rate-rps"), (["--rate-rps", "nan"], "--rate-rps"),
                        (["--rate-rps", "1e12"], "the trace's own"), (["--rate-rps", "2", "--speedup", "2"], "not both")):
        assert main([*common, *flags]) == 2
        assert said in capsys.readouterr().err


def test_attainment_after_warmup_grades_as_an_envelope_probe_does():
    import pandas as pd

    from flexpipe_dag.sim.results import attainment_after_warmup

    frame = pd.DataFrame({"slo_met": [False, False, True, True, True, True, False, True]})
    assert attainment_after_warmup(frame) == pytest.approx(5 / 6)  # the first 2 of 8 are the warm-up
    assert attainment_after_warmup(frame, 0.0) == pytest.approx(5 / 8)
    assert attainment_after_warmup(frame.iloc[:1], 0.25) == 0.0  # nothing after the warm-up: every row counts
    assert attainment_after_warmup(frame.iloc[:0]) == 0.0
