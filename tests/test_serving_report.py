"""The serve summary (lost / duplicated accounting, percentiles per class) and the HTML report."""

from __future__ import annotations

import statistics

from flexpipe_dag.core.metrics import MetricSample, StageSample
from flexpipe_dag.serving.report import load_vs_gear_png, summarize, write_html_report


def _results():
    return [{"id": f"r{i}", "klass": "online" if i < 8 else "offline", "output_tokens": 10, "ttft_ms": 100.0 + i,
             "tpot_ms": 20.0, "e2e_ms": 300.0 + i} for i in range(10)]


def test_summary_counts_lost_and_duplicates():
    results = _results()
    s = summarize(results, submitted=10, elapsed_s=10.0, shifts=[])
    assert (s["served"], s["lost"], s["duplicates"]) == (10, 0, 0)
    assert s["output_tokens_per_s"] == 10.0
    assert s["by_class"]["online"]["served"] == 8 and s["by_class"]["offline"]["served"] == 2
    online_ttft = [r["ttft_ms"] for r in results if r["klass"] == "online"]
    assert s["by_class"]["online"]["ttft_p50_ms"] == statistics.median(online_ttft)  # even count: a midpoint
    assert len(online_ttft) % 2 == 0 and statistics.median(online_ttft) not in online_ttft
    s = summarize(results[:9] + [results[0]], submitted=10, elapsed_s=10.0, shifts=[])
    assert (s["served"], s["lost"], s["duplicates"]) == (9, 1, 1)


def test_html_report_embeds_the_three_figures(tmp_path):
    samples = [MetricSample(t_s=2.0 * i, gear_id="a" if i < 5 else "b", source="live", rps=1.0 + i % 3, completed=1,
                            tokens_per_s=10.0, queue_length=0, running=1, kv_used_fraction=0.1,
                            stages=(StageSample(0, 0.5, 0, 1, 10), StageSample(1, 0.4, 0, 1, 10)))
               for i in range(1, 11)]
    shifts = [{"t_s": 10.0, "from_gear": "a", "to_gear": "b", "trigger": "rps_above_envelope", "status": "done",
               "reason": "rps 3 above envelope max 2 for 3 samples"}]
    summary = summarize(_results(), submitted=10, elapsed_s=20.0, shifts=shifts)
    path = write_html_report(tmp_path / "r" / "report.html", "test run", summary, samples, _results(), notes=["n1"])
    text = path.read_text()
    assert text.count("data:image/png;base64,") == 3
    assert "rps 3 above envelope max 2" in text and "lost 0" in text


def test_load_vs_gear_shades_more_gears_than_the_palette_holds():
    """Pastel1 lists 9 colours: a tenth gear reuses one (it used to fail with a KeyError)."""
    samples = [MetricSample(t_s=2.0 * i, gear_id=f"g{i:02d}", source="live", rps=1.0, completed=1, tokens_per_s=10.0,
                            queue_length=0, running=1, kv_used_fraction=0.1) for i in range(1, 12)]
    assert load_vs_gear_png(samples, []).startswith(b"\x89PNG")
