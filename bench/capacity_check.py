"""Capacity plans checked in the simulator: the planned card count vs the smallest count the simulator confirms.

Usage: python bench/capacity_check.py [--requests 300] [--gpu-types A100-SXM-80GB,L40S,A10]

Six cases: three bundled models (Llama-2-7B, Llama-3-8B, Mistral-7B) x two SLOs (TTFT 2 s / TPOT
100 ms, and the tighter TTFT 1 s / TPOT 60 ms), at 4 req/s of the Azure LLM 2023 conversation trace
(CC-BY-4.0), with the design's 15 % reserve and the bundled example prices.

For each case :func:`~flexpipe_dag.planner.capacity.capacity_report` plans each GPU type alone and
the cheapest mix (exact ILP), replays each fleet in the simulator and, where a replay misses, re-solves
with measured envelopes. The card count checked is that of the cheapest single type. The smallest
count the simulator confirms: every pipeline option of that type gets its envelope measured in the
simulator (:func:`~flexpipe_dag.planner.envelope.measure_envelope`); for ``n = 1, 2, ...`` cards the
instances with the most measured capacity on at most ``n`` cards
(:func:`~flexpipe_dag.planner.capacity_mix.max_rps_within`) are replayed at the load (each at its
share); the first ``n`` that holds the load and keeps the promise (attainment >= 0.95, nothing lost)
is the smallest confirmed count. Goals, printed as met / not met:

* the plan's count is confirmed, and equals the smallest confirmed count or exceeds it by one card
  (the reserve);
* the cheapest mix costs no more than the best single type (it is at most that by construction; the
  figure shows by how much it saves).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexpipe_dag.planner.capacity import capacity_report, confirm_mix, trace_figures
from flexpipe_dag.planner.capacity_mix import max_rps_within
from flexpipe_dag.planner.envelope import measure_envelope
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.planner.prices import load_prices
from flexpipe_dag.sim.config import SimConfig
from flexpipe_dag.workload.bundled import load_trace

MODELS = ("Llama-2-7B", "Llama-3-8B", "Mistral-7B")
SLOS_MS = ((2000.0, 100.0), (1000.0, 60.0))
LOAD_RPS = 4.0
GPU_TYPES = "A100-SXM-80GB,L40S,A10"


#: How many cards above the plan's count the search for the smallest confirmed count goes.
MAX_EXTRA_CARDS = 4


def measured_options(plan, type_plan, trace, model, requests: int) -> list:
    """The type's pipeline options with their envelopes measured in the simulator (bisection on the rate)."""
    need = plan.need
    config = SimConfig(max_context_tokens=model.max_context_tokens)
    return [dataclasses.replace(o, rps_max=measure_envelope(
        o.gear, o.timing, trace, slo_ttft_ms=need.slo_ttft_ms, slo_tpot_ms=need.slo_tpot_ms,
        attainment=plan.slo_attainment, num_requests=requests, start_rps=o.rps_max, sim_config=config).rps_max)
        for o in type_plan.options]


def smallest_confirmed(plan, type_plan, trace, model, requests: int) -> int | None:
    """The fewest cards of the type whose best configuration the simulator confirms at the plan's load.

    For ``n = 1, 2, ...`` cards: the instances with the most *measured* SLO capacity on at most ``n``
    cards that hold the KV need (:func:`max_rps_within`); the first ``n`` whose measured capacity holds
    the load (no reserve) and whose replay keeps the promise.
    """
    need = plan.need
    options = measured_options(plan, type_plan, trace, model, requests)
    for n in range(1, type_plan.mix.cards + MAX_EXTRA_CARDS + 1):
        config = max_rps_within(options, cards=n, kv_need_tokens=need.kv_need_tokens,
                                reserve_fraction=need.reserve_fraction)
        if config is None or config.rps_max < need.load_rps:
            continue
        if confirm_mix(config, need, trace, num_requests=requests, slo_attainment=plan.slo_attainment,
                       max_context_tokens=model.max_context_tokens).passed:
            return n
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="trace requests replayed per instance (default 300)")
    ap.add_argument("--gpu-types", default=GPU_TYPES, help=f"GPU types considered (default {GPU_TYPES})")
    args = ap.parse_args(argv)
    trace = load_trace("azure-conv")
    prices = load_prices()
    types = args.gpu_types.split(",")
    print(f"capacity check: {len(MODELS)} models x {len(SLOS_MS)} SLOs at {LOAD_RPS:g} req/s of azure-conv, "
          f"types {', '.join(types)}, {args.requests} requests per replay, reserve 15 %")
    rows, met_count, met_cost = [], 0, 0
    for name in MODELS:
        model = ModelSpec.from_builtin(name)
        served = trace_figures(trace, model).served
        for ttft, tpot in SLOS_MS:
            t0 = time.perf_counter()
            plan = capacity_report(model, trace, prices, load_rps=LOAD_RPS, slo_ttft_ms=ttft, slo_tpot_ms=tpot,
                                   gpu_types=types, confirm_requests=args.requests)
            best = plan.best_single_type()
            assert best is not None and best.mix is not None and plan.mix is not None
            smallest = smallest_confirmed(plan, best, served, model, args.requests)
            planned_ok = best.confirmation is not None and best.confirmation.passed
            n = best.mix.cards
            ok_count = planned_ok and smallest is not None and n - smallest in (0, 1)
            ratio = plan.mix.cost_per_hour / best.mix.cost_per_hour
            met_count += ok_count
            met_cost += ratio <= 1 + 1e-9
            conf = plan.confirmation
            rows.append((name, f"{ttft:g}/{tpot:g}", best.gpu_type, n, smallest, planned_ok, ok_count,
                         plan.mix.cards_by_type(), plan.mix.cost_per_hour, best.mix.cost_per_hour, ratio,
                         conf.slo_attainment if conf else float("nan"), time.perf_counter() - t0))
            r = rows[-1]
            print(f"{r[0]:<11} SLO {r[1]:>9} ms | best type {r[2]:<14} plan {r[3]:>3} cards, smallest confirmed "
                  f"{r[4] if r[4] is not None else '-':>3} ({'plan confirmed' if r[5] else 'plan NOT confirmed'}) "
                  f"goal {'met' if r[6] else 'not met'} | mix {r[7]} {r[8]:.2f} vs best type {r[9]:.2f} USD/h "
                  f"(x{r[10]:.3f}) | mix attainment {r[11]:.3f} | {r[12]:.0f} s", flush=True)
    print(f"card count goal (equal or +1, plan confirmed): met in {met_count}/{len(rows)} cases -> "
          f"{'met' if met_count == len(rows) else 'not met'}")
    print(f"mix cost <= best single type: {met_cost}/{len(rows)} -> {'met' if met_cost == len(rows) else 'not met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
