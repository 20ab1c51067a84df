"""Human CLI output: numbers readable at any magnitude, tables that fit any width, ids never cut;
``simulate --gear-file`` priced by the cost model when no ``--timing`` is given."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from flexpipe_dag.calibration.report import format_report
from flexpipe_dag.cli import main
from flexpipe_dag.cli.plan import _print_table
from flexpipe_dag.cli.simulate import summary_renderables
from flexpipe_dag.cli.tables import format_number, format_pair, format_range, new_table
from flexpipe_dag.sim import LinearStageTiming, manual_gear

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
WIDTHS = (60, 80, 200)
LONG_ID = "throughput-7s-3ecf626a-manual-x"  # 31 characters, like a hand-named gear
# one figure per token: 12,345.6 / 1.5e+07 / -3.0e-04 / inf / 12% / 5.59..14.43
NUMBER = re.compile(r"^-?(inf|\d{1,3}(,\d{3})*(\.\d+)?|\d\.\de[+-]\d\d)%?$")


def _record(width: int) -> Console:
    return Console(width=width, record=True, color_system=None, force_terminal=False)


def _figures(text: str) -> list[str]:
    """Every token of ``text`` that starts like a figure (box-drawing characters and '/' separate tokens)."""
    tokens = re.split(r"[\s\u2500-\u257f/]+", text)
    out = []
    for tok in tokens:
        for part in tok.split(".."):
            if part and (part[0].isdigit() or part in ("inf", "-inf")):
                out.append(part.rstrip("(),;:"))
    return out


def _assert_figures_apart(text: str) -> None:
    bad = [f for f in _figures(text) if not NUMBER.match(f) and not re.match(r"^\d+-\d+$", f)]
    assert not bad, f"figures run together or malformed: {bad}\n{text}"


def test_format_number_any_magnitude():
    assert format_number(None) == "-" and format_number(float("nan")) == "-"
    assert format_number(float("inf")) == "inf" and format_number(float("-inf")) == "-inf"
    assert format_number(12345.678) == "12,345.7" and format_number(12345.678, 0) == "12,346"
    assert format_number(9_999_999.4) == "9,999,999.4"
    assert format_number(1.5e7) == "1.5e+07" and format_number(3e10) == "3.0e+10"
    assert format_number(10**12) == "1.0e+12" and format_number(1e12) == "1.0e+12"
    assert format_number(123_456) == "123,456" and format_number(11_999_999) == "11,999,999"
    assert format_number(0.0004) == "4.0e-04" and format_number(0.0) == "0.0"
    assert format_number(2.5, unit=" ms") == "2.5 ms"
    assert format_pair(1.5e7, 3e10, 0) == "1.5e+07 / 3.0e+10"
    assert format_range(5.59, float("inf")) == "5.59..inf"
    with pytest.raises(TypeError):
        format_number("12")


def _plan_gears():
    from flexpipe_dag.core.cluster import load_cluster_profile
    from flexpipe_dag.planner.gears import plan_gears
    from flexpipe_dag.planner.model_spec import load_model_spec

    cluster = load_cluster_profile(EXAMPLES / "seed_example.yaml")
    gears = list(plan_gears(cluster, load_model_spec("SmolLM2-135M"), concurrency=8, context_p95_tokens=2048))
    big = gears[0].model_copy(update={
        "gear_id": LONG_ID, "rps_max": float("inf"),
        "estimate": gears[0].estimate.model_copy(update={
            "tokens_per_s": 3e10, "throughput_rps": 2.5e8, "ttft_p50_ms": 1.5e7, "ttft_p99_ms": 3e10,
            "tpot_p50_ms": 1.5e7, "tpot_p99_ms": float("inf")})})
    return cluster, [*gears, big]


@pytest.mark.parametrize("width", WIDTHS)
def test_plan_table_keeps_ids_and_figures_apart(width):
    cluster, gears = _plan_gears()
    console = _record(width)
    _print_table(cluster.cluster_id, "SmolLM2-135M", "bf16", gears, console=console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width
    for g in gears:
        assert g.gear_id in text, f"{g.gear_id} cut at width {width}:\n{text}"
    assert "1.5e+07" in text and "3.0e+10" in text and "..inf" in text
    _assert_figures_apart(text)
    for tag in ("…", "..."):  # nothing ellipsised
        assert not any(line.rstrip().endswith(tag) for line in text.splitlines())


def _summary(**ms):
    lat = {"mean": ms.get("mean", 1.5e7), "p50": 1.5e7, "p95": 3e10, "p99": float("inf")}
    return {
        "requests": 12_000_000, "completed": 11_999_999, "rejected": 1, "unfinished": 0, "preemptions": 0,
        "makespan_s": 3e10, "ttft_ms": dict(lat), "tpot_ms": dict(lat), "e2e_ms": {**lat, "p99": float("nan")},
        "throughput_rps": 6.1, "tokens_per_s": 84.3, "goodput_rps": 6.1, "slo_attainment": 1.0,
        "slo": {"ttft_ms": 2000.0, "tpot_ms": 200.0}, "stage_utilisation": {LONG_ID: [0.65, 0.5]},
        "queue_length": {"mean": 0.0, "p95": 0.0, "max": 2e7}, "kv_used_fraction": {"mean": 0.1, "p95": 0.2, "max": 0.3},
        "shifts": 0, "gear_id": LONG_ID, "final_gear_id": LONG_ID,
        "by_class": {"online": {"requests": 12_000_000, "completed": 11_999_999, "ttft_ms": dict(lat),
                                "goodput_rps": 6.1}},
    }


@pytest.mark.parametrize("width", WIDTHS)
def test_simulate_table_figures_apart_at_any_magnitude(width):
    console = _record(width)
    for item in summary_renderables(_summary()):
        console.print(item)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width
    assert LONG_ID in text
    assert "1.5e+07" in text and "3.0e+10" in text
    rows = [line for line in text.splitlines() if "TTFT ms" in line]
    if rows and "1.5e+07" in rows[0]:  # the table layout: mean P50 P95 P99 on the row, P99 inf
        assert re.search(r"1\.5e\+07\s+\S?\s*1\.5e\+07\s+\S?\s*3\.0e\+10\s+\S?\s*inf", rows[0]), rows[0]
    else:  # the record layout: one figure per line
        assert re.search(r"P99\s+inf", text)
    _assert_figures_apart(text)


def test_id_folds_whole_when_wider_than_the_console():
    table = new_table(None, ["gear", "n"], ids=["gear"])
    table.add_row(LONG_ID, format_number(3e10))
    console = _record(20)
    console.print(table)
    text = console.export_text()
    joined = re.sub(r"[\s\u2500-\u257f]+", "", text)
    assert LONG_ID in joined and "3.0e+10" in joined
    assert "…" not in text


def test_calibration_report_keeps_long_gear_id():
    gid = "balanced-4s-0123abcd-recalibrated-long"
    row = {"gear_id": gid, "metric": "decode", "stage": 1, "kind": "decode", "count": 5,
           "measured_ms": 1.5e7, "before_ms": 3e10, "after_ms": 1.6e7}
    text = format_report([row])
    assert gid in text


def _gear_file(tmp_path, capsys) -> tuple[Path, dict]:
    assert main(["plan", "--cluster", str(EXAMPLES / "seed_example.yaml"), "--model", "SmolLM2-135M",
                 "--concurrency", "8", "--context-p95", "2048", "--requests", "60", "--json"]) == 0
    gear = json.loads(capsys.readouterr().out)["gears"][-1]
    path = tmp_path / "gear.json"
    path.write_text(json.dumps(gear))
    return path, gear


def test_simulate_gear_file_priced_by_cost_model(tmp_path, capsys):
    path, gear = _gear_file(tmp_path, capsys)
    common = ["--cluster", str(EXAMPLES / "seed_example.yaml"), "--trace", "azure-code", "--window-s", "0", "60", "--json"]
    assert main(["simulate", "--gear-file", str(path), "--model", "SmolLM2-135M", *common]) == 0
    by_file = json.loads(capsys.readouterr().out)
    assert main(["simulate", "--gear-file", str(path), *common]) == 0  # model from the gear's model_name
    by_name = json.loads(capsys.readouterr().out)
    assert by_file["gear_id"] == gear["gear_id"] and by_file["completed"] == by_file["workload_requests"]
    for key in ("makespan_s", "ttft_ms", "tpot_ms"):
        assert by_file[key] == by_name[key]


def test_simulate_gear_file_without_stage_times_says_what_to_pass(tmp_path, capsys):
    path, _ = _gear_file(tmp_path, capsys)
    timing = tmp_path / "stages.csv"
    LinearStageTiming.uniform(1, decode_fixed_ms=6).to_frame().to_csv(timing, index=False)
    assert main(["simulate", "--gear-file", str(path), "--trace", "azure-code"]) == 2
    err = capsys.readouterr().err
    assert "--timing" in err and "--cluster" in err and "prefill_fixed_ms" in err and str(path) in err
    assert main(["simulate", "--gear-file", str(path), "--timing", str(timing), "--cluster",
                 str(EXAMPLES / "seed_example.yaml"), "--trace", "azure-code"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["simulate", "--gear-file", str(path), "--cluster", str(EXAMPLES / "seed_example.yaml"),
                 "--model", "Llama-3-8B", "--trace", "azure-code"]) == 2
    assert "gear.json: num_layers" in capsys.readouterr().err
    hand = manual_gear([2, 2], gear_id="hand", model_name="no-such-model")
    hand_path = tmp_path / "hand.json"
    hand_path.write_text(hand.model_dump_json())
    assert main(["simulate", "--gear-file", str(hand_path), "--cluster", str(EXAMPLES / "seed_example.yaml"),
                 "--trace", "azure-code"]) == 2
    assert "--model" in capsys.readouterr().err


def test_simulate_help_documents_timing(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = capsys.readouterr().out
    assert "--timing" in out and "decode_per_seq_ms" in out


def test_gear_file_prices_like_the_planner_gear(tmp_path, capsys, monkeypatch):
    cluster = str(EXAMPLES / "fragmented_lab.yaml")
    assert main(["plan", "--cluster", cluster, "--model", "Llama-3-8B", "--requests", "60", "--json"]) == 0
    gear = json.loads(capsys.readouterr().out)["gears"][-1]
    path = tmp_path / "throughput.json"
    path.write_text(json.dumps(gear))
    common = ["--cluster", cluster, "--trace", "azure-conv", "--window-s", "0", "30", "--json"]
    assert main(["simulate", "--gear-file", str(path), *common]) == 0
    by_file = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("FLEXPIPE_REFERENCE_REQUESTS", "60")  # simulate plans as plan does, same settings
    assert main(["simulate", "--gear", "throughput", "--model", "Llama-3-8B", *common]) == 0
    by_planner = json.loads(capsys.readouterr().out)
    assert by_planner["gear_id"] == gear["gear_id"]  # one code path: simulate --gear KIND is plan's gear
    # Llama-2-70B on the lab fleet keeps only its throughput gear (the others are marginal at zero load)
    assert main(["simulate", "--gear", "latency", "--model", "Llama-2-70B", *common]) == 2
    assert "--gear: this plan has no latency gear" in capsys.readouterr().err
    for key in ("makespan_s", "ttft_ms", "tpot_ms", "completed"):
        assert by_file[key] == by_planner[key]
    assert "note:" not in capsys.readouterr().err  # the planner's own figures: the devices agree with them
    # an edited gear: all 32 layers on one T4 (15 GiB of weights on 12.8 usable) was simulated as served
    t4 = dict(gear, stages=[dict(gear["stages"][0], stage_index=0, layer_start=0, layer_end=32,
                                 device_ids=["host-t4-gpu0"], weight_gib=1.0)])
    path.write_text(json.dumps(t4))
    assert main(["simulate", "--gear-file", str(path), *common]) == 2
    err = capsys.readouterr().err
    assert "throughput.json: stages[0]: layers 0-32 of Llama-3-8B" in err and "leave no room for a KV block on " \
        "host-t4-gpu0" in err
    # a KV pool of 0 in the file read as unbounded: the devices' pool is simulated, and said so
    unbounded = dict(gear, kv_capacity_tokens=0, stages=[dict(st, kv_capacity_tokens=0) for st in gear["stages"]])
    path.write_text(json.dumps(unbounded))
    assert main(["simulate", "--gear-file", str(path), *common]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["completed"] == by_file["completed"]
    assert f"kv_capacity_tokens: the file says 0 tokens (0 = unbounded), the devices hold {gear['kv_capacity_tokens']}" \
        in err


def _subparsers(parser) -> dict:
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def test_every_command_help_renders():
    """Every ``flexpipe COMMAND --help`` (and nested ones) formats: a help string with a bare ``%`` (a
    percentage) breaks argparse's formatter only when ``--help`` is asked for."""
    from flexpipe_dag.cli import build_parser

    todo = [("flexpipe", build_parser())]
    seen = 0
    while todo:
        name, parser = todo.pop()
        text = parser.format_help()
        assert text.startswith("usage:"), name
        seen += 1
        todo.extend((f"{name} {sub}", p) for sub, p in _subparsers(parser).items())
    assert seen > 10


def test_text_from_a_users_file_is_printed_as_it_is_never_as_markup(tmp_path, capsys, monkeypatch):
    """Seen: a device's model_name "A100[/]" in a native profile crashed `flexpipe profile` with rich's MarkupError
    (a traceback), and "[link=...]" in a price file's source printed a hidden hyperlink."""
    from flexpipe_dag.cli.tables import plain_console, render_text
    from flexpipe_dag.core.cluster import load_cluster_profile

    doc = load_cluster_profile(Path(__file__).resolve().parents[1] / "examples" / "clusters" / "seed_example.yaml")
    data = doc.to_dict()
    data["devices"][0]["model_name"] = "A100[/]"
    data["devices"][1]["model_name"] = "[link=http://evil.example]T4[/link]"
    path = tmp_path / "native.json"
    path.write_text(json.dumps(data))
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["profile", "--cluster", str(path), "--no-store"]) == 0
    out = capsys.readouterr().out
    assert "A100[/]" in out and "[link=http://evil.example]T4[/link]" in out and "\x1b]8;" not in out
    table = new_table("[red]title[/]", ["id", "n"], ids=["id"])
    table.add_row("[bold]x[/bold] [/]", "1")
    text = render_text(table)
    assert "[red]title[/]" in text and "[bold]x[/bold] [/]" in text
    console = plain_console(width=80, record=True, file=io.StringIO())
    console.print(":thumbs_up: [/]")
    assert console.export_text().strip() == ":thumbs_up: [/]"


@pytest.mark.parametrize("width", [40, 200])
def test_the_caption_is_printed_at_any_width(width):
    """Seen: on an 80-column terminal capacity's table fell back to records and its caption (the prices are
    examples, not a quote) was not printed."""
    from flexpipe_dag.cli.tables import render_text

    table = new_table("cards", ["gpu type", "cards", "cost per hour", "cost per 1M output tokens"], ids=["gpu type"])
    table.add_row("A100-SXM-80GB-with-a-long-name", "12", "61.44", "2.659")
    table.caption = "prices: bundled example list prices, examples only"
    text = render_text(table, width=width)
    assert "prices: bundled example list prices, examples only" in " ".join(text.split())
