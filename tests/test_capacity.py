"""Capacity planning: the arithmetic by hand, the price file, the exact ILP, the CLI and the Dagster asset."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from dagster import materialize

from flexpipe_dag.cli import main
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.planner.capacity import homogeneous_cluster
from flexpipe_dag.planner.capacity_math import (
    capacity_need,
    cards_by_memory,
    check_reserve,
    little_concurrency,
    need_steps,
)
from flexpipe_dag.planner.capacity_mix import InstanceOption, Mix, cheapest_mix, max_rps_within
from flexpipe_dag.planner.envelope import CONFIRM_PROBE_S
from flexpipe_dag.planner.model_spec import GIB, ModelSpec
from flexpipe_dag.planner.prices import load_prices

pytest.importorskip("scipy.optimize")

A100 = "A100-SXM-80GB"


# -- the arithmetic, by hand ---------------------------------------------------------------------
def test_llama3_8b_bf16_kv_is_128_kib_per_token_and_little_concurrency():
    need = capacity_need(ModelSpec.from_builtin("Llama-3-8B"), dtype="bf16", load_rps=2.0, slo_ttft_ms=1000.0,
                         slo_tpot_ms=50.0, context_p95_tokens=2048, output_p95_tokens=400, reserve_fraction=0.15)
    assert need.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072  # 128 KiB
    assert need.weight_bytes == 8030261248 * 2  # 8.03 B parameters in bf16
    assert need.residence_s == pytest.approx(21.0)  # 1 s + 400 x 50 ms
    assert need.concurrency == 42  # ceil(2 req/s x 21 s)
    assert need.kv_need_tokens == 42 * 2048 == 86016
    assert need.kv_need_bytes == 86016 * 131072
    assert "KV per token: 2 x layers x kv_heads x head_dim x bytes = 131072 B = 128 KiB" in need_steps(need)


def test_little_concurrency_rounds_up_and_is_at_least_one():
    assert little_concurrency(0.5, 2000.0, 100.0, 100) == (pytest.approx(12.0), 6)
    assert little_concurrency(0.01, 100.0, 10.0, 1) == (pytest.approx(0.11), 1)
    assert little_concurrency(3.0, 500.0, 25.0, 20)[1] == 3  # exactly 1.0 s x 3 req/s: no spurious extra


def test_llama3_70b_needs_more_than_one_80gb_card():
    model = ModelSpec.from_builtin("Llama-3-70B")
    need = capacity_need(model, dtype="bf16", load_rps=1.0, slo_ttft_ms=2000.0, slo_tpot_ms=100.0,
                         context_p95_tokens=2048, output_p95_tokens=400)
    assert need.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327680  # 320 KiB
    assert need.weight_bytes / GIB == pytest.approx(131.4165, abs=1e-4)  # 70.55 B parameters in bf16
    usable = homogeneous_cluster(A100, 1).devices[0].usable_memory_gib(0.15)
    assert usable == pytest.approx((80.0 - 0.5) * 0.85)  # 67.575 GiB: CUDA context, then the 15 % reserve
    whole, smallest = cards_by_memory(need, usable * GIB)
    assert need.concurrency == 42 and need.kv_need_bytes == 42 * 2048 * 327680
    assert smallest == 2  # (131.42 GiB + one 2048-token sequence 0.625 GiB) / 67.575 = 1.95
    assert whole == 3  # (131.42 + 26.25 GiB of KV) / 67.575 = 2.33


def test_reserve_outside_the_design_range_is_refused():
    assert check_reserve(0.1) == 0.1
    with pytest.raises(InputError, match=r"--reserve: expected 0.1..0.15"):
        check_reserve(0.2)


def test_load_beyond_the_ceiling_is_refused_not_overflowed(capsys):
    # 1e300 req/s overflowed the card arithmetic (OverflowError traceback)
    with pytest.raises(InputError, match=r"--load-rps: expected a load > 0 and <= 1e\+06 req/s, got 1e\+300"):
        capacity_need(ModelSpec.from_builtin("Llama-3-8B"), dtype="bf16", load_rps=1e300, slo_ttft_ms=1000.0,
                      slo_tpot_ms=50.0, context_p95_tokens=400, output_p95_tokens=100)
    rc = main(["capacity", "--model", "Llama-3-8B", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100", "--load-rps",
               "1e300", "--gpu-types", "T4", "--no-simulate"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("flexpipe capacity: error: --load-rps: ") and len(err.splitlines()) == 1


def test_output_p95_over_context_is_refused():
    with pytest.raises(InputError, match="--output-p95: 500 tokens exceeds the P95 context of 400"):
        capacity_need(ModelSpec.from_builtin("Llama-3-8B"), dtype="bf16", load_rps=1.0, slo_ttft_ms=1000.0,
                      slo_tpot_ms=50.0, context_p95_tokens=400, output_p95_tokens=500)


# -- prices ----------------------------------------------------------------------------------------
def test_bundled_prices_are_examples_for_catalog_types():
    prices = load_prices()
    assert prices.currency == "USD" and "example" in prices.source
    assert prices.price("T4") == 0.53 and prices.price(A100) == 5.12


@pytest.mark.parametrize(("body", "field", "problem"), [
    ("per_gpu_hour:\n  T4: -1\n", "per_gpu_hour.T4", "expected a price per GPU-hour > 0"),
    ("per_gpu_hour:\n  T4: .nan\n", "per_gpu_hour.T4", "got nan"),
    ("per_gpu_hour:\n  T4: 0\n", "per_gpu_hour.T4", "expected a price per GPU-hour > 0"),
    # a subnormal price passed and made the ILP's costs infinite (a traceback from scipy)
    ("per_gpu_hour:\n  T4: 1.0e-320\n", "per_gpu_hour.T4", "expected a price per GPU-hour > 0, from 1e-06 to 10000"),
    ("per_gpu_hour:\n  X9000: 1.0\n", "per_gpu_hour.X9000", "unknown GPU type 'X9000'"),
    ("per_gpu_hour:\n  T4: cheap\n", "per_gpu_hour.T4", "expected a price per GPU-hour (a number > 0), got 'cheap'"),
    ("per_gpu_hour:\n  T4: 1.0\ndiscount: 0.1\n", "discount", "Extra inputs are not permitted"),
    # printed on terminals: a terminal escape in the currency or the provenance is refused, not echoed
    ('currency: "U\\x1b[31mSD"\nper_gpu_hour:\n  T4: 1.0\n', "currency", "expected printable text"),
    ('source: "a\\u202eb"\nper_gpu_hour:\n  T4: 1.0\n', "source", "expected printable text"),
    ("currency: USD\n", "per_gpu_hour", "Field required"),
    ("per_gpu_hour:\n  T4: 1" + "0" * 400 + "\n", "per_gpu_hour.T4", "expected a price per GPU-hour > 0, from 1e-06 to 10000"),
])
def test_price_file_validation_names_file_and_field(tmp_path, body, field, problem):
    path = tmp_path / "prices.yaml"
    path.write_text(body)
    with pytest.raises(InputError) as exc:
        load_prices(path)
    assert exc.value.source == str(path) and exc.value.field == field
    assert problem in exc.value.problem


def test_type_without_price_is_refused(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("per_gpu_hour:\n  T4: 0.5\n")
    with pytest.raises(InputError, match="no price for L4; the file prices T4"):
        load_prices(path).price("L4")


def test_type_without_price_names_the_price_file_not_its_provenance(tmp_path):
    # the file's ``source`` (where its prices come from) was named as if it were the file
    path = tmp_path / "p.yaml"
    path.write_text('per_gpu_hour:\n  T4: 0.5\nsource: "my quote"\n')
    with pytest.raises(InputError) as exc:
        load_prices(path).price("L4")
    assert exc.value.source == str(path) and exc.value.field == "per_gpu_hour.L4"
    with pytest.raises(InputError) as exc:
        load_prices().price("H200-SXM")
    assert exc.value.source == "flexpipe_dag/data/gpu_prices.yaml"


# -- the exact ILP ---------------------------------------------------------------------------------
def _opt(gpu: str, cards: int, rps: float, price: float, kv: int = 10**6) -> InstanceOption:
    return InstanceOption(gpu_type=gpu, cards=cards, rps_max=rps, kv_capacity_tokens=kv, price_per_card_hour=price)


def test_ilp_picks_the_cheaper_mix_over_either_type_alone():
    a, b = _opt("A", 1, 6.0, 1.0), _opt("B", 1, 4.0, 0.7)
    # load 8 at 15 % reserve: A alone needs 2 cards (10.2 req/s, 2.00/h), B alone 3 (10.2, 2.10/h);
    # one of each carries (6 + 4) x 0.85 = 8.5 >= 8 for 1.70/h
    assert cheapest_mix([a], load_rps=8.0, kv_need_tokens=1, reserve_fraction=0.15).cost_per_hour == 2.0
    assert cheapest_mix([b], load_rps=8.0, kv_need_tokens=1, reserve_fraction=0.15).cost_per_hour == pytest.approx(2.1)
    mix = cheapest_mix([a, b], load_rps=8.0, kv_need_tokens=1, reserve_fraction=0.15)
    assert mix.cost_per_hour == pytest.approx(1.7) and mix.cards_by_type() == {"A": 1, "B": 1}
    assert mix.rps_with_reserve == pytest.approx(8.5)


def test_ilp_answers_the_same_at_any_price_scale():
    """Seen: a T4 at 1e-12 USD/h was a 610-card mix where 60 cards carry the load (the solver's tolerances swallowed
    the costs, and the fewest-cards tie-break with them); the answer must not depend on the currency unit."""
    def mix(scale):
        options = [_opt("T4", k, 0.08 * k, 0.35 * scale) for k in (2, 3, 4, 5)] + [_opt("A10", 1, 0.3, 1.0 * scale)]
        return cheapest_mix(options, load_rps=2.0, kv_need_tokens=1, reserve_fraction=0.15)

    reference = mix(1.0)
    for scale in (1e-12, 1e-7, 1e6):
        other = mix(scale)
        assert [(o.gpu_type, o.cards, k) for o, k in other.instances] == \
            [(o.gpu_type, o.cards, k) for o, k in reference.instances]
        assert other.cost_per_hour == pytest.approx(reference.cost_per_hour * scale)


def test_steps_write_tiny_prices_readably():
    """Seen: at 1e-12 USD per card-hour the steps said the mix costs "0.00 USD/h"."""
    from flexpipe_dag.planner.capacity import CapacityPlan, TypePlan

    need = capacity_need(ModelSpec.from_builtin("Llama-3-8B"), dtype="bf16", load_rps=2.0, slo_ttft_ms=2000.0,
                         slo_tpot_ms=100.0, context_p95_tokens=2048, output_p95_tokens=400)
    option = _opt("T4", 2, 3.0, 1e-12)
    mix = cheapest_mix([option], load_rps=2.0, kv_need_tokens=1, reserve_fraction=0.15)
    t = TypePlan("T4", 1e-12, 14.0, 2, 2, [option], mix)
    plan = CapacityPlan(need, 200, 0.95, [t], mix, "USD", "test")
    steps = "\n".join(plan.steps())
    assert "2.0e-12 USD/h" in steps and "0.00 USD/h" not in steps
    assert f"{mix.cards} cards, 2.0e-12 USD/h" in steps


def test_ilp_takes_the_roomiest_of_the_sets_that_cost_the_same():
    # seen: with A100 and T4 priced, "A100 alone" was 1 x 2 A100 (7.33 req/s) while two 1-card A100
    # pipelines carry 11.43 req/s on the same 2 cards for the same price; ties went whichever way HiGHS found
    pair, single = _opt("A100", 2, 7.33, 5.12), _opt("A100", 1, 5.715, 5.12)
    for options in ([pair, single], [single, pair]):
        mix = cheapest_mix(options, load_rps=6.0, kv_need_tokens=1, reserve_fraction=0.15)
        assert mix.cost_per_hour == pytest.approx(10.24) and [(o.cards, k) for o, k in mix.instances] == [(1, 2)]
        assert mix.rps_with_reserve == pytest.approx(2 * 5.715 * 0.85)
    # a cheaper set still wins over a roomier dearer one
    dear = _opt("H100", 1, 50.0, 11.0)
    assert cheapest_mix([pair, dear], load_rps=6.0, kv_need_tokens=1, reserve_fraction=0.15).cards_by_type() == {"A100": 2}


def test_ilp_respects_the_kv_need_and_skips_options_without_envelope():
    fast_small = _opt("A", 1, 100.0, 1.0, kv=1000)
    roomy = _opt("B", 2, 1.0, 1.0, kv=50_000)
    dead = _opt("C", 1, 0.0, 0.01)
    mix = cheapest_mix([fast_small, roomy, dead], load_rps=1.0, kv_need_tokens=60_000, reserve_fraction=0.1)
    # 60,000 KV tokens: 2 x roomy (4 cards, 100,000 tokens) costs 4.0; 1 roomy + 10 fast_small costs 12.0
    assert [(o.gpu_type, k) for o, k in mix.instances] == [("B", 2)] and mix.kv_capacity_tokens == 100_000
    assert cheapest_mix([dead], load_rps=1.0, kv_need_tokens=1, reserve_fraction=0.1) is None


def test_kv_on_an_instance_that_carries_almost_nothing_does_not_count():
    # the helper's case: a cheap pipeline with a huge KV pool and an envelope of 0.001 req/s was added
    # to a mix only to meet the pooled KV need, which it cannot hold: its pool counts only up to what
    # its own share of the load keeps in flight (kv_need / load per req/s it carries)
    carrier = _opt("H", 2, 0.4, 5.0, kv=20_000)
    idle_pool = _opt("A", 3, 0.001, 1.0, kv=200_000)
    mix = cheapest_mix([carrier, idle_pool], load_rps=1.0, kv_need_tokens=112_000, reserve_fraction=0.15)
    assert "A" not in mix.cards_by_type()
    # each carrier holds 20,000 of the 0.34 x 112,000 = 38,080 its share needs: 6 of them, not 3
    assert mix.cards_by_type() == {"H": 12}


def test_max_rps_within_a_card_budget():
    two, three = _opt("A", 2, 5.0, 1.0), _opt("A", 3, 9.0, 1.0)
    best = max_rps_within([two, three], cards=7, kv_need_tokens=1, reserve_fraction=0.15)
    assert best.cards == 7 and best.rps_max == 19.0  # 2 + 2 + 3 cards beat 2 x 3 (18) and 3 x 2 (15)
    assert max_rps_within([three], cards=2, kv_need_tokens=1, reserve_fraction=0.15) is None


# -- the command ------------------------------------------------------------------------------------
def test_infeasible_tpot_is_refused_with_the_reason(capsys):
    rc = main(["capacity", "--model", "Llama-3-8B", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "1", "--load-rps", "1",
               "--gpu-types", A100, "--no-simulate"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1
    assert err.startswith("flexpipe capacity: infeasible: TPOT SLO 1 ms is below what any card reaches for Llama-3-8B: "
                          f"the fastest, {A100}, takes ")
    assert "ms per output token even unloaded" in err


def test_gpu_type_named_twice_is_refused(capsys):
    # T4,T4 planned T4 twice and printed two identical rows
    rc = main(["capacity", "--model", "Llama-3-8B", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100", "--load-rps", "1",
               "--gpu-types", "T4,L4,T4", "--no-simulate"])
    assert rc == 2
    assert "--gpu-types: GPU type 'T4' named twice; expected each type once" in capsys.readouterr().err


def test_a_trace_of_a_handful_of_requests_confirms_nothing(tmp_path, capsys):
    # a 3-request trace was "confirmed in the simulator: SLO attainment 1.000 (promised >= 0.95)"
    trace = tmp_path / "t.csv"
    trace.write_text("request_id,arrival_s,input_tokens,output_tokens\n1,0,10,10\n2,1,10,10\n3,2,10,10\n")
    argv = ["capacity", "--model", "Llama-3-8B", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100", "--load-rps", "1",
            "--gpu-types", "L40S", "--trace", str(trace)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{trace}: requests: the trace has 3 request(s)" in err
    assert "needs at least 50" in err and "--no-simulate" in err
    assert main([*argv, "--no-simulate"]) == 0  # the arithmetic alone still runs on it


def test_requests_are_checked_only_when_the_simulator_replays_them(capsys, monkeypatch):
    # --requests 49 --no-simulate was refused although nothing is replayed without the simulator
    argv = ["capacity", "--model", "Llama-3-8B", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100", "--load-rps", "1",
            "--gpu-types", "T4", "--requests", "49"]
    assert main(argv) == 2
    assert "--requests: expected an integer >= 50" in capsys.readouterr().err
    assert main([*argv, "--no-simulate"]) == 0
    assert main([*argv[:-1], "-5", "--no-simulate"]) == 2  # but a count it is, replayed or not
    assert "--requests: expected an integer >= 1" in capsys.readouterr().err
    monkeypatch.setenv("FLEXPIPE_REFERENCE_REQUESTS", "10")  # nor is the variable read then
    assert main([*argv[:-2], "--no-simulate"]) == 0


def test_bad_price_file_exits_2_naming_it(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text("per_gpu_hour:\n  A100-SXM-80GB: -3\n")
    rc = main(["capacity", "--model", "Llama-3-8B", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100", "--load-rps", "1",
               "--price-file", str(path)])
    assert rc == 2
    assert f"{path}: per_gpu_hour.A100-SXM-80GB: expected a price per GPU-hour > 0" in capsys.readouterr().err


def test_cli_json_shape_and_simulator_confirmation(capsys):
    rc = main(["capacity", "--model", "Llama-3-8B", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100", "--load-rps", "2",
               "--gpu-types", f"{A100},A10", "--context-p95", "2048", "--output-p95", "400", "--requests", "60", "--json"])
    assert rc == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert ("warning: the plan was confirmed on replays, per instance, of 60 requests of azure-conv: a sample under "
            "1000 requests may not represent the trace") in captured.err
    assert set(out) >= {"need", "types", "mix", "confirmation", "steps", "currency", "price_source"}
    need = out["need"]
    assert need["kv_bytes_per_token"] == 131072 and need["concurrency"] == 84  # ceil(2 x (2 s + 400 x 0.1 s))
    assert need["kv_need_tokens"] == 84 * 2048 and need["reserve_fraction"] == 0.15
    assert [t["gpu_type"] for t in out["types"]] == [A100, "A10"]
    mix = out["mix"]
    assert mix["cards"] == sum(i["cards"] * i["count"] for i in mix["instances"]) >= 1
    assert mix["rps_with_reserve"] >= 2.0 and mix["kv_capacity_tokens"] >= mix["kv_need_tokens"]
    singles = [t["plan"]["cost_per_hour"] for t in out["types"] if t["plan"]]
    assert mix["cost_per_hour"] <= min(singles) + 1e-9
    price = {A100: 5.12, "A10": 1.01}
    assert mix["cost_per_hour"] == pytest.approx(sum(n * price[g] for g, n in mix["cards_by_type"].items()))
    tokens_per_hour = 2.0 * out["output_tokens_mean"] * 3600 / 1e6
    assert mix["cost_per_million_output_tokens"] == pytest.approx(mix["cost_per_hour"] / tokens_per_hour)
    conf = out["confirmation"]
    assert conf["load_rps"] == 2.0 and 0 <= conf["slo_attainment"] <= 1
    # each instance is replayed as an envelope is confirmed: at least 300 s of arrivals (2 req/s: 600 > 60 asked)
    assert conf["num_requests"] >= 60 and conf["replay_s"] >= 0.99 * CONFIRM_PROBE_S
    assert all(row["replay_s"] >= conf["replay_s"] and row["requests"] >= conf["num_requests"]
               for row in conf["per_option"])
    assert conf["passed"] == (conf["slo_attainment"] >= 0.95 and conf["lost"] == 0)
    for t in out["types"]:  # every type's fleet is replayed too
        assert t["plan"] is None or t["confirmation"]["load_rps"] == 2.0
    assert any(s.startswith("concurrency (Little's law") for s in out["steps"])
    assert any(s.startswith("cheapest mix (exact ILP)") for s in out["steps"])


# -- the asset ---------------------------------------------------------------------------------------
def test_capacity_plan_asset_materialises(tmp_path, monkeypatch):
    from flexpipe_dag.assets.capacity import capacity_plan, forecast_peak_rps
    from flexpipe_dag.control.tide import load_history
    from flexpipe_dag.resources.control import ControlSettings
    from flexpipe_dag.resources.planning import PlanningSettings

    monkeypatch.setenv("FLEXPIPE_HOME", str(tmp_path))
    control = ControlSettings()
    planning = PlanningSettings(model="SmolLM2-135M", reference_requests=60, load_rps=0.2)
    result = materialize([capacity_plan], resources={"planning": planning, "control": control},
                         run_config={"ops": {"capacity_plan": {"config": {"gpu_types": "T4"}}}})
    assert result.success
    meta = result.asset_materializations_for_node("capacity_plan")[0].metadata
    peak, _ = forecast_peak_rps(load_history(control.tide_config()), 0.2)
    profile = load_history(control.tide_config()).daily_profile()
    assert peak == pytest.approx(0.2 * profile.max() / profile.mean())
    assert meta["load_rps"].value == pytest.approx(peak)
    assert meta["cards"].value >= 1 and meta["cards_by_type"].value == {"T4": meta["cards"].value}
    assert meta["cost_per_hour"].value == pytest.approx(0.53 * meta["cards"].value)
    assert not math.isnan(meta["simulated_slo_attainment"].value)
    assert "Little's law" in meta["steps"].value


def test_a_plan_the_simulator_refutes_is_re_solved_with_measured_envelopes():
    from flexpipe_dag.planner.capacity import (
        capacity_need,
        confirm_mix,
        plan_capacity,
        refine_with_simulator,
        trace_figures,
    )
    from flexpipe_dag.workload.bundled import load_trace

    model = ModelSpec.from_builtin("Llama-3-8B")
    figures = trace_figures(load_trace("azure-conv"), model)
    need = capacity_need(model, dtype="bf16", load_rps=2.0, slo_ttft_ms=2000.0, slo_tpot_ms=100.0,
                         context_p95_tokens=2048, output_p95_tokens=400)
    plan = plan_capacity(model, need, figures.workload, load_prices(), [A100], instance_sizes=2)
    (option, _), = plan.mix.instances
    # promise 100 times the analytic envelope at 20 times its load: one pipeline, which the replay refutes
    inflated = dataclasses.replace(option, rps_max=option.rps_max * 100)
    heavy = dataclasses.replace(need, load_rps=20 * option.rps_max)
    t = plan.types[0]
    options = [inflated if o is option else o for o in t.options]
    bad_mix = Mix([(inflated, 1)], 0.15)
    bad = dataclasses.replace(plan, need=heavy, types=[dataclasses.replace(t, options=options, mix=bad_mix)],
                              mix=bad_mix)
    bad.confirmation = confirm_mix(bad_mix, heavy, figures.served, num_requests=200,
                                   max_context_tokens=model.max_context_tokens)
    assert not bad.confirmation.passed
    fixed = refine_with_simulator(bad, figures.served, num_requests=200, max_context_tokens=model.max_context_tokens)
    (note,) = fixed.notes
    assert note.startswith(f"the simulator measured the {inflated.cards} x {A100} pipeline's envelope at ")
    measured = next(o for o in fixed.types[0].options if o.cards == inflated.cards)
    assert measured.rps_max < inflated.rps_max
    assert fixed.mix.rps_with_reserve >= heavy.load_rps and fixed.confirmation is not None
    assert any(line.startswith("simulator: the simulator measured") for line in fixed.steps())
