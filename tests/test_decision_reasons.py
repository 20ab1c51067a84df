"""Decision reasons an operator can act on (issue #16, item 9): the SLO in the user's units, payback arithmetic
that adds up, one request-rate definition, "no gear holds this load", declines in the serve report."""

from __future__ import annotations

import pytest

from flexpipe_dag.control import Controller, ControllerConfig
from flexpipe_dag.control.payback import figure, payback_arithmetic
from flexpipe_dag.core.gear import EnvelopeBasis
from flexpipe_dag.core.metrics import MetricSample, StageSample
from flexpipe_dag.runtime.live_metrics import LiveMetrics
from flexpipe_dag.runtime.scheduler import PRIORITY_OFFLINE
from flexpipe_dag.serving.report import decline_episodes, summarize, write_html_report
from flexpipe_dag.sim import LinearStageTiming, manual_gear, simulate
from flexpipe_dag.workload import Request, Workload
from tests.test_control_controller import BAL, GEARS, LAT, THR, feed, sample

#: The SLO the user planned with (TTFT 4 s, TPOT 600 ms, as the demo sets it), recorded with every planned gear.
BASIS = EnvelopeBasis(source="simulator", slo_ttft_ms=4000.0, slo_tpot_ms=600.0, attainment=0.95,
                      workload="azure-conv", num_requests=60)
#: The gears as the planner stores them: the SLO in their envelope basis, and their own target (the TTFT P99
#: measured at rps_max on a slow CPU gear, the figure reasons used to quote).
PLANNED = [g.model_copy(update={"envelope_basis": BASIS, "target_p99_ms": 266913.0}) for g in GEARS]


# ------------------------------------------------------------------------------ SLO in the user's units
def test_latency_reasons_quote_the_slo_the_user_set_not_the_gears_own_target():
    ctrl = Controller()
    _, ds = feed(ctrl, None, PLANNED, [sample(2 * i, "lat", rps=3.0, p99_ms=5000.0) for i in range(1, 4)])
    assert ds[0].reason == ("hold: latency_over (ttft_p99 5000 ms > 1.2 x SLO TTFT 4000 ms, 1 samples) of 3 needed; "
                            "rps 3/s in envelope [0, 5]; ttft_p99 5000 ms vs SLO TTFT 4000 ms; "
                            "stage utilisation 0.70..0.70")
    assert ds[0].reason_kind == "counting" and ds[-1].trigger == "latency_over"
    _, ds = feed(ctrl, None, PLANNED, [sample(2, "lat", rps=3.0, p99_ms=3000.0)])
    assert ds[0].reason == ("hold: no trigger (rps 3/s in envelope [0, 5]; ttft_p99 3000 ms vs SLO TTFT 4000 ms; "
                            "stage utilisation 0.70..0.70)")
    assert ds[0].reason_kind == "no_trigger"
    assert "266913" not in ds[0].reason
    _, ds = feed(ctrl, None, PLANNED, [sample(2, "lat", rps=8.0, p99_ms=3100.0)])
    assert ds[0].reason == ("hold: rps_above_envelope (rps 8/s above envelope max 5, 1 samples) of 3 needed; "
                            "rps 8/s above envelope [0, 5]; ttft_p99 3100 ms vs SLO TTFT 4000 ms; "
                            "stage utilisation 0.70..0.70")


def test_the_slo_is_the_latency_target_the_triggers_use():
    # 3000 ms is under 0.7 x 266913 ms (the gear's own target) but not under 0.7 x the 4000 ms SLO: no trigger
    st, ds = feed(Controller(), None, PLANNED, [sample(2 * i, "lat", rps=3.0, p99_ms=3000.0) for i in range(1, 4)])
    assert [d.reason_kind for d in ds] == ["no_trigger"] * 3 and st.counts == {}
    assert Controller().target_p99_ms(PLANNED[0]) == 4000.0


@pytest.mark.parametrize(("config", "gear", "text"), [
    (ControllerConfig(), PLANNED[0], "SLO TTFT 4000 ms"),
    (ControllerConfig(latency_metric="tpot_p99_ms"), PLANNED[0], "SLO TPOT 600 ms"),
    (ControllerConfig(target_p99_ms=1500.0), PLANNED[0], "target 1500 ms"),  # controller.target_p99_ms wins
    (ControllerConfig(latency_metric="e2e_p99_ms"), PLANNED[0], "gear target 266913 ms"),  # no e2e SLO
    (ControllerConfig(), LAT, "gear target 1000 ms"),  # a gear planned without an SLO
])
def test_target_text_names_where_the_target_comes_from(config, gear, text):
    assert Controller(config).target_text(gear) == text
    assert Controller(config).target_p99_ms(gear) == float(text.split()[-2])


# ------------------------------------------------------------------------------------ payback arithmetic
@pytest.mark.parametrize(("value", "text"), [
    (0.0004, "0.0004"), (0.000412, "0.000412"), (0.72, "0.72"), (56.25, "56.2"), (1800.0, "1800"),
    (0.0, "0"), (-95.94, "-95.9"), (12345.6, "12346"), (1e-7, "0.0000001"),
])
def test_figure_gives_three_significant_figures_without_an_exponent(value, text):
    assert figure(value) == text


@pytest.mark.parametrize(("args", "kw", "text"), [
    # the example: 0.000 x 1800 = 0.7 was a gain of 0.0004 shown to 3 decimals, against a cost of 0
    ((0.0004, 1800.0, 0.0), {},
     "gain 0.0004 x residence 1800 s = 0.72 s > migration cost 0 s (none estimated: no weights move, no drain counted)"),
    ((0.2, 1800.0, 1e5), {}, "gain 0.2 x residence 1800 s = 360 s <= migration cost 100000 s"),
    ((0.425, 1800.0, 30.0), {"cost_estimated": False},
     "gain 0.425 x residence 1800 s = 765 s > migration cost 30 s (default, not estimated)"),
    # -0.05333 x 1800 = -96: the gain gets the fourth digit the product needs (-0.0533 x 1800 = -95.9)
    ((-0.0533333, 1800.0, 30.0), {}, "gain -0.05333 x residence 1800 s = -96 s <= migration cost 30 s"),
    # 30.004 against 30: more digits, so the two sides never read alike
    ((30.004 / 1800, 1800.0, 30.0), {}, "gain 0.016669 x residence 1800 s = 30.004 s > migration cost 30 s"),
])
def test_payback_arithmetic_adds_up_and_takes_its_sign_from_the_test(args, kw, text):
    assert payback_arithmetic(*args, **kw) == text


def test_a_gain_below_the_minimum_is_said_so_and_the_arithmetic_stays_true():
    ctrl = Controller(ControllerConfig(min_gain_fraction=0.5))
    _, ds = feed(ctrl, None, GEARS, [sample(2 * i, "lat", rps=8.0) for i in range(1, 4)],
                 migration_cost_s=lambda a, b: 0.0)
    d = ds[-1]
    assert d.declined and d.reason_kind == "payback" and d.estimated_gain_fraction == pytest.approx(0.425)
    assert d.reason == ("declined: rps_above_envelope (rps 8/s above envelope max 5, 3 samples); shift to bal does not "
                        "pay back: gain 0.425 x residence 1800 s = 765 s > migration cost 0 s (none estimated: no "
                        "weights move, no drain counted), but the gain is below min_gain_fraction 0.5; none of the 1 "
                        "other candidate(s) pays back either")


def test_a_taken_shift_shows_its_payback_and_kind():
    _, ds = feed(Controller(), None, GEARS, [sample(2 * i, "lat", rps=8.0) for i in range(1, 4)],
                 migration_cost_s=lambda a, b: 12.5)
    assert ds[-1].action == "shift" and ds[-1].reason_kind == "shift"
    assert ds[-1].reason == ("shift lat (latency) -> bal (balanced): rps_above_envelope (rps 8/s above envelope max 5, "
                             "3 samples); gain 0.425 x residence 1800 s = 765 s > migration cost 12.5 s")


# ----------------------------------------------------------------------------------- no gear holds the load
def test_no_gear_holds_the_load_when_the_serving_gear_is_the_roomiest():
    _, ds = feed(Controller(), None, GEARS, [sample(2 * i, "thr", rps=25.0) for i in range(1, 4)])
    d = ds[-1]
    assert d.declined and d.reason_kind == "no_gear_holds" and d.to_gear_id is None
    assert d.reason == ("declined: rps_above_envelope (rps 25/s above envelope max 20, 3 samples); no gear holds this "
                        "load: rps 25/s is outside every healthy gear's envelope (lat [0, 5], bal [2, 10], thr [4, 20]) "
                        "narrowed by the 5 % margin (0 of 3 gears unhealthy)")


def test_no_gear_holds_the_load_rather_than_does_not_pay_back():
    _, ds = feed(Controller(), None, GEARS, [sample(2 * i, "lat", rps=25.0) for i in range(1, 4)],
                 migration_cost_s=lambda a, b: 1e5)
    d = ds[-1]
    assert d.declined and d.reason_kind == "no_gear_holds" and d.to_gear_id == "bal"
    assert d.reason == ("declined: rps_above_envelope (rps 25/s above envelope max 5, 3 samples); no gear holds this "
                        "load: rps 25/s is outside every healthy gear's envelope (lat [0, 5], bal [2, 10], thr [4, 20]) "
                        "narrowed by the 5 % margin (0 of 3 gears unhealthy); the best effort, bal, does not pay back: "
                        "gain 0.2 x residence 1800 s = 360 s <= migration cost 100000 s; none of the 1 other "
                        "candidate(s) pays back either")


def test_a_best_effort_shift_says_no_gear_holds_the_load():
    _, ds = feed(Controller(), None, GEARS, [sample(2 * i, "lat", rps=25.0) for i in range(1, 4)],
                 migration_cost_s=lambda a, b: 12.5)
    assert ds[-1].action == "shift" and ds[-1].reason.endswith(
        "gain 0.2 x residence 1800 s = 360 s > migration cost 12.5 s (best effort: no gear holds rps 25/s)")


def test_unhealthy_gears_do_not_hold_the_load():
    _, ds = feed(Controller(), None, GEARS, [sample(2 * i, "lat", rps=8.0) for i in range(1, 4)],
                 unhealthy={"thr", "bal"})
    assert ds[-1].reason_kind == "no_gear_holds" and ds[-1].reason.endswith(
        "no gear holds this load: rps 8/s is outside every healthy gear's envelope (lat [0, 5]) narrowed by the 5 % "
        "margin (2 of 3 gears unhealthy)")


def test_gears_that_hold_the_load_but_not_for_this_trigger_are_no_candidate():
    _, ds = feed(Controller(), None, [LAT, THR], [sample(2 * i, "lat", rps=3.0, p99_ms=200.0) for i in range(1, 6)])
    assert ds[-1].reason_kind == "no_candidate"
    assert ds[-1].reason == ("declined: latency_under (ttft_p99 200 ms < 0.7 x gear target 1000 ms, 5 samples), but no "
                             "healthy gear whose envelope holds rps 3/s suits it (0 of 2 gears unhealthy)")


def test_a_decline_inside_the_dwell_is_kind_dwell():
    ctrl = Controller()
    st, _ = feed(ctrl, None, GEARS, [sample(2 * i, "lat", rps=8.0) for i in range(1, 4)])
    _, ds = feed(ctrl, st, GEARS, [sample(6 + 2 * i, "bal", rps=25.0) for i in range(1, 5)])
    assert ds[-1].reason_kind == "dwell" and ds[-1].to_gear_id == THR.gear_id
    assert ds[-1].reason == ("declined: rps_above_envelope (rps 20.9/s above envelope max 10, 4 samples); inside dwell "
                             "(0.1 of 10.0 min), threshold stays at 4 samples")
    assert BAL.gear_id == ds[-1].from_gear_id


# ---------------------------------------------------------------------------- one request-rate definition
def test_live_samples_count_online_arrivals_only():
    m = LiveMetrics("g1", start_s=0.0)
    m.record_arrivals(4)
    m.record_arrivals(6, PRIORITY_OFFLINE)  # admitted offline work and shift probes are not the online load
    s = m.sample(2.0, queue_length=0, running=0, kv_blocks_used=0, kv_blocks_total=10, micro_batches_sent=0, stages=[])
    assert s.rps == 2.0


def test_simulated_samples_count_online_arrivals_only():
    timing = LinearStageTiming.uniform(1, prefill_fixed_ms=1)
    gear = manual_gear([1], micro_batch_size=8, max_inflight_micro_batches=1)
    reqs = [Request(f"on{i}", 0.5 * i, 10, 1, "online") for i in range(8)]  # 2 req/s over 4 s
    reqs += [Request(f"off{i}", 0.1 + 0.25 * i, 10, 1, "offline") for i in range(16)]  # 4 req/s over 4 s
    res = simulate(Workload.from_requests(reqs, name="mix"), gear, timing)
    arrived = sum(s.rps * 2.0 for s in res.samples)  # 2-s windows
    assert arrived == pytest.approx(8.0) and res.samples[0].rps == 2.0


# --------------------------------------------------------------------------------------- declines reported
DECLINES = [
    {"t_s": 10.0, "from_gear": "lat", "to_gear": "bal", "trigger": "rps_above_envelope", "kind": "dwell",
     "reason": "declined: a; inside dwell (0.1 of 10.0 min)"},
    {"t_s": 12.0, "from_gear": "lat", "to_gear": "bal", "trigger": "rps_above_envelope", "kind": "dwell",
     "reason": "declined: a; inside dwell (0.2 of 10.0 min)"},
    {"t_s": 14.0, "from_gear": "lat", "to_gear": None, "trigger": "rps_above_envelope", "kind": "no_gear_holds",
     "reason": "declined: b; no gear holds this load: rps 25/s is outside every healthy gear's envelope"},
    {"t_s": 16.0, "from_gear": "lat", "to_gear": "bal", "trigger": "rps_above_envelope", "kind": "dwell",
     "reason": "declined: a; inside dwell (0.3 of 10.0 min)"},
]


def test_alike_consecutive_declines_fold_into_one_episode():
    assert decline_episodes(list(reversed(DECLINES))) == [
        {"first_t_s": 10.0, "last_t_s": 12.0, "count": 2, "from_gear": "lat", "to_gear": "bal",
         "triggers": "rps_above_envelope", "kind": "dwell", "reason": "declined: a; inside dwell (0.2 of 10.0 min)"},
        {"first_t_s": 14.0, "last_t_s": 14.0, "count": 1, "from_gear": "lat", "to_gear": None,
         "triggers": "rps_above_envelope", "kind": "no_gear_holds",
         "reason": "declined: b; no gear holds this load: rps 25/s is outside every healthy gear's envelope"},
        {"first_t_s": 16.0, "last_t_s": 16.0, "count": 1, "from_gear": "lat", "to_gear": "bal",
         "triggers": "rps_above_envelope", "kind": "dwell", "reason": "declined: a; inside dwell (0.3 of 10.0 min)"},
    ]


def test_declines_of_one_kind_with_alternating_triggers_are_one_episode():
    """Seen in the demo: the load above every envelope and latency well under the SLO fire in turn while no gear
    holds the load; that is one situation, one episode, its triggers listed in the order they fired."""
    alternating = [{"t_s": 20.0 + 2 * i, "from_gear": "thr", "to_gear": None, "kind": "no_gear_holds",
                    "trigger": ("rps_above_envelope", "latency_under", "forecast_above_envelope")[i % 3],
                    "reason": f"declined: {i}"} for i in range(7)]
    assert decline_episodes(alternating) == [
        {"first_t_s": 20.0, "last_t_s": 32.0, "count": 7, "from_gear": "thr", "to_gear": None,
         "triggers": "rps_above_envelope, latency_under, forecast_above_envelope", "kind": "no_gear_holds",
         "reason": "declined: 6"}]


def test_the_html_report_lists_declined_shifts(tmp_path):
    samples = [MetricSample(t_s=2.0 * i, gear_id="lat", source="live", rps=1.0, completed=1, tokens_per_s=10.0,
                            queue_length=0, running=1, kv_used_fraction=0.1, stages=(StageSample(0, 0.5, 0, 1, 10),))
               for i in range(1, 10)]
    results = [{"id": "r0", "klass": "online", "output_tokens": 4, "ttft_ms": 10.0, "tpot_ms": 2.0, "e2e_ms": 20.0}]
    summary = summarize(results, submitted=1, elapsed_s=18.0, shifts=[], declines=DECLINES)
    assert len(summary["declines"]) == 3
    text = write_html_report(tmp_path / "r.html", "t", summary, samples, results).read_text()
    assert "<h2>Declined shifts</h2><p>3 episode(s)" in text
    assert ("<tr><td>10.0</td><td>12.0</td><td>2</td><td>lat</td><td>bal</td><td>rps_above_envelope</td><td>dwell</td>"
            "<td>declined: a; inside dwell (0.2 of 10.0 min)</td></tr>") in text
    assert "<td>-</td><td>rps_above_envelope</td><td>no_gear_holds</td>" in text
