"""Capacity plans checked in the simulator: the planned card count vs the smallest count the simulator confirms.

Usage: python bench/capacity_check.py [--requests 300] [--gpu-types A100-SXM-80GB,L40S,A10]

Six cases: three bundled models (Llama-2-7B, Llama-3-8B, Mistral-7B) x two SLOs (TTFT 2 s / TPOT
100 ms, and the tighter TTFT 1 s / TPOT 60 ms), at 4 req/s of the Azure LLM 2023 conversation trace
(CC-BY-4.0), with the design's 15 % reserve and the bundled example prices.

For each case :func:`~flexpipe_dag.planner.capacity.capacity_report` plans each GPU type alone and
the cheapest mix (exact ILP). The card count checked is that of the cheapest single type. Then, for
the same type and instance options, the simulator replays the trace at the load on the configuration
with the most SLO capacity that fits in ``N``, ``N - 1``, ... cards
(:func:`~flexpipe_dag.planner.capacity_mix.max_rps_within`; each instance at its share), down to the
first count whose replay misses the promise (attainment >= 0.95, nothing lost): the smallest count
confirmed. Goals, printed as met / not met:

* the plan's count is confirmed, and equals the smallest confirmed count or exceeds it by one card
  (the reserve);
* the cheapest mix costs no more than the best single type (it is at most that by construction; the
  figure shows by how much it saves).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexpipe_dag.planner.capacity import capacity_report, confirm_mix, trace_figures
from flexpipe_dag.planner.capacity_mix import max_rps_within
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.planner.prices import load_prices
from flexpipe_dag.workload.bundled import load_trace

MODELS = ("Llama-2-7B", "Llama-3-8B", "Mistral-7B")
SLOS_MS = ((2000.0, 100.0), (1000.0, 60.0))
LOAD_RPS = 4.0
GPU_TYPES = "A100-SXM-80GB,L40S,A10"


#: How many cards above the plan's count are tried when the plan's own count is not confirmed.
MAX_EXTRA_CARDS = 4


def _confirmed(plan, type_plan, trace, model, requests: int, cards: int) -> bool | None:
    """Whether the most SLO capacity on ``cards`` cards of the type passes the replay (None: no configuration)."""
    need = plan.need
    config = max_rps_within(type_plan.options, cards=cards, kv_need_tokens=need.kv_need_tokens,
                            reserve_fraction=need.reserve_fraction)
    if config is None:
        return None
    return confirm_mix(config, need, trace, num_requests=requests, slo_attainment=plan.slo_attainment,
                       max_context_tokens=model.max_context_tokens).passed


def smallest_confirmed(plan, type_plan, trace, model, requests: int) -> tuple[int | None, bool]:
    """``(smallest confirmed count, plan's count confirmed)`` for ``type_plan``'s options at the plan's load.

    Down from the plan's count while the replay passes; when the plan's count itself fails, up to
    :data:`MAX_EXTRA_CARDS` more until one passes.
    """
    cards = type_plan.mix.cards
    if not _confirmed(plan, type_plan, trace, model, requests, cards):
        for n in range(cards + 1, cards + MAX_EXTRA_CARDS + 1):
            if _confirmed(plan, type_plan, trace, model, requests, n):
                return n, False
        return None, False
    smallest = cards
    for n in range(cards - 1, 0, -1):
        if not _confirmed(plan, type_plan, trace, model, requests, n):
            break
        smallest = n
    return smallest, True


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
            smallest, planned_ok = smallest_confirmed(plan, best, served, model, args.requests)
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
