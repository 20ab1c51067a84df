"""Capacity planning: how many (and which) cards serve a model at a load and an SLO, with the reserve.

The path, for each GPU type asked about (every step shown in :meth:`CapacityPlan.steps`):

1. the load's needs by hand-checkable arithmetic (:mod:`flexpipe_dag.planner.capacity_math`: weights,
   KV per token, concurrency by Little's law, KV need at the P95 context, the reserve);
2. memory per card from the datasheet catalog (driver-visible GiB, CUDA context, reserve) and the
   smallest pipeline by memory, ``n_min`` cards (weights + one P95 sequence);
3. **compute**: for pipelines of ``n_min .. n_min + instance_sizes - 1`` cards of that type, the gear
   planner (:func:`~flexpipe_dag.planner.gears.candidate_plans`, the same search ``flexpipe plan``
   runs) proposes plans on a homogeneous cluster of that many cards; each is priced by the analytic
   SLO envelope at the user's TTFT / TPOT (:func:`~flexpipe_dag.planner.envelope_model.estimate_envelope`)
   and the plan with the highest envelope becomes that size's *instance option* (its gear, envelope
   ``rps_max`` and KV pool). An instance is planned for ``min(concurrency, what its KV pool holds at
   the P95 context)`` sequences;
4. the card count: the exact integer program of :mod:`flexpipe_dag.planner.capacity_mix` over that
   type's options (instances add up; each loaded to at most ``1 - reserve`` of its envelope; their KV
   pools hold the KV need), and over all types' options together for the cheapest mix;
5. cost per hour and per million output tokens at the load (``cost_per_hour / (load_rps x mean
   output tokens x 3600 / 1e6)``);
6. :func:`confirm_plan` replays the trace through the simulator at the load for the mix and each
   type's fleet (:func:`confirm_mix`: each instance at its share, proportional to its envelope), and
   reports the measured SLO attainment beside the promise; when one misses,
   :func:`refine_with_simulator` measures the failing pipelines' envelopes in the simulator,
   re-solves with them and replays again (at most :data:`MAX_REFINEMENTS` rounds).

A load no card type can serve within the SLO (e.g. a TPOT target below the fastest card's decode
step for the model) raises :class:`~flexpipe_dag.core.errors.InfeasibleError` with the reason.

Pure: no Dagster, SQL or torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexpipe_dag.core.catalog import gpu_catalog
from flexpipe_dag.core.cluster import ClusterProfile, parse_cluster_profile
from flexpipe_dag.core.errors import InfeasibleError, InputError
from flexpipe_dag.core.numbers import format_number
from flexpipe_dag.planner.capacity_math import DEFAULT_RESERVE, CapacityNeed, capacity_need, cards_by_memory, need_steps
from flexpipe_dag.planner.capacity_mix import InstanceOption, Mix, cheapest_mix
from flexpipe_dag.planner.envelope import (
    CONFIRM_PROBE_S,
    probe_gear,
    probe_reference,
    reference_slice,
    screen_zero_load,
)
from flexpipe_dag.planner.envelope_model import estimate_envelope
from flexpipe_dag.planner.gears import candidate_plans, make_search, to_gear
from flexpipe_dag.planner.model_spec import GIB, ModelSpec
from flexpipe_dag.planner.operating import MIN_REFERENCE_REQUESTS
from flexpipe_dag.planner.prices import GpuPrices
from flexpipe_dag.planner.workload import PlanWorkload
from flexpipe_dag.sim.config import SimConfig
from flexpipe_dag.workload.context import apply_context_rule
from flexpipe_dag.workload.request import Workload
from flexpipe_dag.workload.transform import MIN_SPEEDUP

#: Pipeline sizes tried per type: ``n_min`` .. ``n_min + DEFAULT_INSTANCE_SIZES - 1`` cards.
DEFAULT_INSTANCE_SIZES = 4
#: Cards per node of a homogeneous cluster (intra-node links between them, the network between nodes).
NODE_CARDS = 8
#: Rounds of :func:`refine_with_simulator` when the chosen fleet's replay misses its promise.
MAX_REFINEMENTS = 2
#: Largest pipeline instance planned, cards (the cluster profile's limit is far above).
MAX_INSTANCE_CARDS = 64


def homogeneous_cluster(gpu_type: str, cards: int) -> ClusterProfile:
    """``cards`` cards of ``gpu_type`` in nodes of :data:`NODE_CARDS` (datasheet figures and links).

    Raises:
        InputError: an unknown GPU type (the catalog's types named) or a bad count.
    """
    if gpu_type not in gpu_catalog():
        raise InputError(None, "--gpu-types", f"unknown GPU type {gpu_type!r}; expected one of {', '.join(gpu_catalog())}")
    if not 1 <= cards <= MAX_INSTANCE_CARDS:
        raise InputError(None, "cards", f"expected 1..{MAX_INSTANCE_CARDS}, got {cards}")
    nodes = [{"node_id": f"n{i}", "gpu_model": gpu_type, "count": min(NODE_CARDS, cards - i * NODE_CARDS)}
             for i in range(math.ceil(cards / NODE_CARDS))]
    return parse_cluster_profile({"cluster_id": f"{gpu_type}-x{cards}", "fleet": nodes}, f"{gpu_type} x {cards}")


@dataclass(frozen=True)
class TraceFigures:
    """What a trace says about the requests (after the model's context rule), tokens per request."""

    prompt_tokens_mean: int
    output_tokens_mean: int
    context_p95_tokens: int
    output_p95_tokens: int
    workload: PlanWorkload
    served: Workload


def trace_figures(trace: Workload, model: ModelSpec) -> TraceFigures:
    """Means and P95s of ``trace`` under ``model``'s context rule (requests over its context left out).

    Raises:
        InputError: the trace is empty or nothing fits the model's context.
    """
    from flexpipe_dag.planner.workload import plan_workload_from_trace

    workload, _ = plan_workload_from_trace(trace, max_context_tokens=model.max_context_tokens)
    served = apply_context_rule(trace, model.max_context_tokens).workload
    out95 = max(1, int(np.percentile([r.output_tokens for r in served.requests], 95)))
    return TraceFigures(workload.prompt_tokens_mean, workload.output_tokens_mean, workload.context_p95_tokens,
                        out95, workload, served)


@dataclass(frozen=True)
class TypePlan:
    """One GPU type: its memory figures, instance options and the cheapest fleet of it alone."""

    gpu_type: str
    price_per_card_hour: float
    usable_gib_per_card: float
    cards_whole_by_memory: int
    cards_smallest_instance: int
    options: list[InstanceOption]
    mix: Mix | None
    best_tpot_idle_ms: float = math.inf
    best_ttft_idle_ms: float = math.inf
    note: str = ""
    confirmation: Confirmation | None = None


@dataclass(frozen=True)
class Confirmation:
    """The chosen fleet replayed in the simulator at the load (each instance at its share).

    ``num_requests`` / ``replay_s``: the fewest requests, and the shortest span of arrivals (s), any
    instance's replay had (each at least :data:`~flexpipe_dag.planner.envelope.CONFIRM_PROBE_S`, as an
    envelope's confirmation, unless the trace replays no slower).
    """

    load_rps: float
    slo_attainment: float
    promised_attainment: float
    lost: int
    num_requests: int
    per_option: list[dict[str, Any]]
    replay_s: float = 0.0

    @property
    def passed(self) -> bool:
        """Measured attainment at least the promise and nothing lost."""
        return self.slo_attainment >= self.promised_attainment and self.lost == 0


@dataclass
class CapacityPlan:
    """The answer: per type alone and the cheapest mix, with the arithmetic (see the module docstring)."""

    need: CapacityNeed
    output_tokens_mean: int
    slo_attainment: float
    types: list[TypePlan]
    mix: Mix | None
    currency: str
    price_source: str
    confirmation: Confirmation | None = None
    notes: list[str] = field(default_factory=list)

    def cost_per_million_output_tokens(self, mix: Mix) -> float:
        """``cost_per_hour / (load_rps x output_tokens_mean x 3600 / 1e6)``, currency per 1e6 output tokens."""
        return mix.cost_per_hour / (self.need.load_rps * self.output_tokens_mean * 3600 / 1e6)

    def all_confirmed(self) -> bool:
        """The mix and every type's fleet were replayed and kept their promise."""
        fleets = [self.confirmation] + [t.confirmation for t in self.types if t.mix is not None]
        return all(c is not None and c.passed for c in fleets)

    def best_single_type(self) -> TypePlan | None:
        """The cheapest type alone (ties: fewer cards), or None when no type serves the load."""
        able = [t for t in self.types if t.mix is not None]
        return min(able, key=lambda t: (t.mix.cost_per_hour, t.mix.cards)) if able else None  # type: ignore[union-attr]

    def steps(self) -> list[str]:
        """The arithmetic, one line per step, from the need to the chosen fleet."""
        lines = need_steps(self.need)
        for t in self.types:
            lines.append(f"{t.gpu_type}: {t.usable_gib_per_card:.2f} GiB usable per card; by memory "
                         f"{t.cards_whole_by_memory} card(s) hold weights + the whole KV need, a pipeline needs at least "
                         f"{t.cards_smallest_instance} (weights + one P95 sequence)")
            for o in t.options:
                gear = (f" (gear {o.gear.gear_id}: {o.gear.num_stages} stage(s), micro-batch {o.gear.micro_batch_size})"
                        if o.gear is not None else "")
                lines.append(f"  {o.cards} x {t.gpu_type} pipeline{gear}: SLO envelope {o.rps_max:.3f} req/s, with reserve "
                             f"{o.rps_max * (1 - self.need.reserve_fraction):.3f}; KV pool {o.kv_capacity_tokens} tokens")
            if t.mix is not None:
                lines.append(f"  {t.gpu_type} alone: {_describe(t.mix)} = {t.mix.cards} cards, carries "
                             f"{t.mix.rps_with_reserve:.3f} >= {self.need.load_rps:g} req/s, KV {t.mix.kv_capacity_tokens} >= "
                             f"{self.need.kv_need_tokens} tokens, {format_number(t.mix.cost_per_hour, 2)} {self.currency}/h"
                             + (f"; simulator: SLO attainment {t.confirmation.slo_attainment:.3f}, lost "
                                f"{t.confirmation.lost}" if t.confirmation is not None else ""))
            elif t.note:
                lines.append(f"  {t.gpu_type}: {t.note}")
        lines += [f"simulator: {note}" for note in self.notes]
        if self.mix is not None:
            lines.append(f"cheapest mix (exact ILP): {_describe(self.mix)} = {self.mix.cards} cards, "
                         f"{format_number(self.mix.cost_per_hour, 2)} {self.currency}/h, "
                         f"{format_number(self.cost_per_million_output_tokens(self.mix), 3)} {self.currency} per 1M output tokens")
        if self.confirmation is not None:
            c = self.confirmation
            lines.append(f"simulator at {c.load_rps:g} req/s on the trace (at least {c.num_requests} requests, "
                         f"{c.replay_s:.0f} s of arrivals per instance): "
                         f"SLO attainment {c.slo_attainment:.3f} (promised >= {c.promised_attainment:g}), lost {c.lost}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: need, per type (options, fleet, cost), the mix, the confirmation and the steps."""
        def mix_dict(m: Mix | None) -> dict[str, Any] | None:
            if m is None:
                return None
            return {"cards": m.cards, "cards_by_type": m.cards_by_type(), "cost_per_hour": m.cost_per_hour,
                    "cost_per_million_output_tokens": self.cost_per_million_output_tokens(m),
                    "rps_max": m.rps_max, "rps_with_reserve": m.rps_with_reserve,
                    "kv_capacity_tokens": m.kv_capacity_tokens, "kv_need_tokens": self.need.kv_need_tokens,
                    "instances": [{"gpu_type": o.gpu_type, "cards": o.cards, "count": k, "rps_max": o.rps_max,
                                   "kv_capacity_tokens": o.kv_capacity_tokens,
                                   "gear_id": o.gear.gear_id if o.gear is not None else None,
                                   "stages": o.gear.num_stages if o.gear is not None else None,
                                   "micro_batch_size": o.gear.micro_batch_size if o.gear is not None else None}
                                  for o, k in m.instances]}

        def conf_dict(c: Confirmation | None) -> dict[str, Any] | None:
            return None if c is None else {**dataclasses.asdict(c), "passed": c.passed}

        return {
            "need": self.need.to_dict(), "output_tokens_mean": self.output_tokens_mean,
            "slo_attainment": self.slo_attainment, "currency": self.currency, "price_source": self.price_source,
            "types": [{"gpu_type": t.gpu_type, "price_per_card_hour": t.price_per_card_hour,
                       "usable_gib_per_card": t.usable_gib_per_card, "cards_whole_by_memory": t.cards_whole_by_memory,
                       "cards_smallest_instance": t.cards_smallest_instance,
                       "options": [{"cards": o.cards, "rps_max": o.rps_max, "kv_capacity_tokens": o.kv_capacity_tokens,
                                    "gear_id": o.gear.gear_id if o.gear is not None else None} for o in t.options],
                       "plan": mix_dict(t.mix), "note": t.note or None,
                       "confirmation": conf_dict(t.confirmation)} for t in self.types],
            "mix": mix_dict(self.mix),
            "confirmation": conf_dict(self.confirmation),
            "notes": self.notes, "steps": self.steps(),
        }


def _describe(mix: Mix) -> str:
    return " + ".join(f"{k} x ({o.cards} x {o.gpu_type})" for o, k in mix.instances)


def _plan_instance(model: ModelSpec, gpu_type: str, cards: int, workload: PlanWorkload, dtype: str,
                   price: float) -> tuple[InstanceOption | None, float, float]:
    """The highest-envelope plan on ``cards`` cards of ``gpu_type``: ``(option or None, idle TPOT, idle TTFT)``."""
    cluster = homogeneous_cluster(gpu_type, cards)
    concurrency = workload.concurrency
    while True:
        search = make_search(cluster, model, dtype=dtype, workload=dataclasses.replace(workload, concurrency=concurrency))
        scored = candidate_plans(search)
        if scored or concurrency == 1:
            break
        concurrency = max(1, concurrency // 2)
    if not scored:
        return None, math.inf, math.inf
    tpot_idle = min(s.estimate.tpot_idle_ms for s in scored)
    ttft_idle = min(s.estimate.ttft_idle_ms for s in scored)
    # every candidate is priced by the fixed-point envelope (the closed form's ranking misses the SLO tails)
    best = max(scored, key=lambda s: (round(estimate_envelope(search, s.plan).rps_at_envelope, 9),
                                     -s.plan.num_stages, -s.plan.micro_batch_size))
    gear = to_gear(search, "throughput", best)
    if gear.rps_max <= 0:
        return None, tpot_idle, ttft_idle
    timing = search.cm.timings(gear)
    option = InstanceOption(gpu_type=gpu_type, cards=len(gear.device_ids), rps_max=gear.rps_max,
                            kv_capacity_tokens=gear.kv_capacity_tokens, price_per_card_hour=price,
                            gear=gear, timing=timing)
    return option, tpot_idle, ttft_idle


def plan_type(model: ModelSpec, need: CapacityNeed, workload: PlanWorkload, gpu_type: str, price: float, *,
              instance_sizes: int = DEFAULT_INSTANCE_SIZES, reference: Workload | None = None) -> TypePlan:
    """Steps 2-4 of the module docstring for one GPU type.

    With ``reference`` (the trace), a pipeline that misses the SLO with nothing else running on more
    than half the allowed share of its requests is left out, as the gear planner leaves such gears out
    (:func:`~flexpipe_dag.planner.envelope.screen_zero_load`): its envelope swings with the traffic mix.
    """
    device = homogeneous_cluster(gpu_type, 1).devices[0]
    usable = device.usable_memory_gib(need.reserve_fraction) * GIB
    whole, smallest = cards_by_memory(need, usable)
    if smallest > MAX_INSTANCE_CARDS:
        return TypePlan(gpu_type, price, usable / GIB, whole, smallest, [], None,
                        note=f"a pipeline needs {smallest} cards by memory, over the {MAX_INSTANCE_CARDS} planned")
    options: list[InstanceOption] = []
    screened: list[str] = []
    seen: set[int] = set()
    tpot_idle = ttft_idle = math.inf
    ws = max(need.concurrency, workload.prefill_chunk_tokens) * model.activation_workspace_bytes_per_token(need.dtype)
    for cards in range(smallest, min(smallest + instance_sizes, MAX_INSTANCE_CARDS + 1)):
        fits = int((cards * (usable - ws) - need.weight_bytes) // need.one_sequence_bytes)
        w = dataclasses.replace(workload, concurrency=max(1, min(need.concurrency, fits)))
        option, t_idle, f_idle = _plan_instance(model, gpu_type, cards, w, need.dtype, price)
        tpot_idle, ttft_idle = min(tpot_idle, t_idle), min(ttft_idle, f_idle)
        if option is not None and reference is not None and option.gear is not None and option.timing is not None:
            screen = screen_zero_load(option.gear, option.timing, reference, slo_ttft_ms=need.slo_ttft_ms,
                                      slo_tpot_ms=need.slo_tpot_ms, attainment=workload.slo_attainment)
            if screen.verdict != "ok":
                screened.append(f"{option.cards} x {gpu_type} {screen.describe()}")
                option = None
        if option is not None and option.cards not in seen:
            seen.add(option.cards)
            options.append(option)
    mix = cheapest_mix(options, load_rps=need.load_rps, kv_need_tokens=need.kv_need_tokens,
                       reserve_fraction=need.reserve_fraction)
    note = "" if mix is not None else (
        f"no pipeline of {smallest}..{smallest + instance_sizes - 1} cards meets the SLO (fastest idle TPOT "
        f"{tpot_idle:.1f} ms, TTFT {ttft_idle:.0f} ms)")
    if screened:
        note = "; ".join(filter(None, [note, "left out: " + "; ".join(screened)]))
    return TypePlan(gpu_type, price, usable / GIB, whole, smallest, options, mix, tpot_idle, ttft_idle, note)


def infeasible_reason(need: CapacityNeed, types: Sequence[TypePlan]) -> str:
    """Why no type serves the load, one sentence naming the binding SLO and the best card."""
    tried = [t for t in types if math.isfinite(t.best_tpot_idle_ms)]
    if not tried:
        return (f"{need.model_name} does not fit any of {', '.join(t.gpu_type for t in types)} within "
                f"{MAX_INSTANCE_CARDS} cards (weights {need.weight_bytes / GIB:.1f} GiB)")
    fast = min(tried, key=lambda t: t.best_tpot_idle_ms)
    if fast.best_tpot_idle_ms > need.slo_tpot_ms:
        return (f"TPOT SLO {need.slo_tpot_ms:g} ms is below what any card reaches for {need.model_name}: the fastest, "
                f"{fast.gpu_type}, takes {fast.best_tpot_idle_ms:.1f} ms per output token even unloaded")
    quick = min(tried, key=lambda t: t.best_ttft_idle_ms)
    if quick.best_ttft_idle_ms > need.slo_ttft_ms:
        return (f"TTFT SLO {need.slo_ttft_ms:g} ms is below what any card reaches for {need.model_name}: the fastest, "
                f"{quick.gpu_type}, takes {quick.best_ttft_idle_ms:.0f} ms to the first token of a mean prompt unloaded")
    return (f"no pipeline of the planned sizes meets TTFT {need.slo_ttft_ms:g} ms and TPOT {need.slo_tpot_ms:g} ms at "
            f"the attainment's tail (best unloaded TPOT {fast.best_tpot_idle_ms:.1f} ms on {fast.gpu_type})")


def plan_capacity(model: ModelSpec, need: CapacityNeed, workload: PlanWorkload, prices: GpuPrices,
                  gpu_types: Sequence[str] | None = None, *, instance_sizes: int = DEFAULT_INSTANCE_SIZES,
                  progress: Callable[[str], None] | None = None, reference: Workload | None = None) -> CapacityPlan:
    """Cards per GPU type alone and the cheapest mix for ``need`` (module docstring, steps 1-5).

    Args:
        workload: planning assumptions (means, P95 context, burstiness); its SLO and reserve are
            replaced by ``need``'s.
        gpu_types: catalog GPU models to consider (default: every type ``prices`` prices).
        reference: the trace; when given, pipelines marginal on it at zero load are left out (:func:`plan_type`).

    Raises:
        InputError: an unknown type, one named twice, or one without a price.
        InfeasibleError: no type serves the load within the SLO (the reason named).
    """
    types = list(gpu_types) if gpu_types else list(prices.per_gpu_hour)
    catalog = gpu_catalog()
    for i, name in enumerate(types):
        if name not in catalog:
            raise InputError(None, "--gpu-types", f"unknown GPU type {name!r}; expected one of {', '.join(catalog)}")
        if name in types[:i]:
            raise InputError(None, "--gpu-types", f"GPU type {name!r} named twice; expected each type once")
    priced = {name: prices.price(name) for name in types}
    w = dataclasses.replace(workload, slo_ttft_ms=need.slo_ttft_ms, slo_tpot_ms=need.slo_tpot_ms,
                            reserve_fraction=need.reserve_fraction, context_p95_tokens=need.context_p95_tokens,
                            concurrency=need.concurrency)
    plans = []
    for name in types:
        if progress:
            progress(f"planning {model.name} on {name}")
        plans.append(plan_type(model, need, w, name, priced[name], instance_sizes=instance_sizes, reference=reference))
    mix = cheapest_mix([o for t in plans for o in t.options], load_rps=need.load_rps,
                       kv_need_tokens=need.kv_need_tokens, reserve_fraction=need.reserve_fraction)
    if mix is None:
        raise InfeasibleError(infeasible_reason(need, plans))
    return CapacityPlan(need=need, output_tokens_mean=w.output_tokens_mean, slo_attainment=w.slo_attainment,
                        types=plans, mix=mix, currency=prices.currency, price_source=prices.source)


def confirm_mix(mix: Mix, need: CapacityNeed, reference: Workload, *, num_requests: int,
                slo_attainment: float = 0.95, max_context_tokens: int | None = None) -> Confirmation:
    """Replay ``reference`` through each instance of ``mix`` at its share of ``need.load_rps``.

    An instance of envelope ``X_o`` gets ``load x X_o / sum(X)`` req/s (a capacity-weighted balancer);
    one instance per option is simulated (instances of one option are alike), on ``num_requests``
    requests drawn from across the trace (:func:`~flexpipe_dag.planner.envelope.probe_reference`), at
    least :data:`~flexpipe_dag.planner.envelope.CONFIRM_PROBE_S` of arrivals as an envelope's
    confirmation (near its top a pipeline takes minutes to fill its seats with long requests), retimed
    to that rate, the first quarter as warm-up. The fleet's attainment is the request-weighted mean of
    the instances'.

    Raises:
        InputError: a degenerate trace; an option whose gear has no timing model (not planned here).
    """
    ref, native = reference_slice(reference, num_requests)
    config = SimConfig(slo_ttft_ms=need.slo_ttft_ms, slo_tpot_ms=need.slo_tpot_ms,
                       max_context_tokens=max_context_tokens)
    rows, met, total, lost = [], 0.0, 0.0, 0
    spans: list[tuple[int, float]] = []  # (requests, seconds of arrivals) per option's replay
    for option, count in mix.instances:
        if option.gear is None or option.timing is None:
            raise InputError(option.gpu_type, "gear", "this instance option was not planned by plan_capacity")
        rate = need.load_rps * option.rps_max / mix.rps_max
        # the trace replays no slower than MIN_SPEEDUP x its own rate: a smaller share is replayed there (more load)
        probe_rate = max(rate, native * MIN_SPEEDUP)
        probe_ref, probe_native = probe_reference(reference, num_requests, probe_rate, need.slo_ttft_ms,
                                                  min_duration_s=CONFIRM_PROBE_S)
        spans.append((len(probe_ref), probe_ref.duration_s * probe_native / probe_rate))
        probe = probe_gear(option.gear, option.timing, probe_ref, probe_native, probe_rate, config=config,
                           attainment=slo_attainment, early_stop=False)
        weight = rate * count
        met += probe.slo_attainment * weight
        total += weight
        lost += probe.lost * count
        rows.append({"gpu_type": option.gpu_type, "cards": option.cards, "instances": count, "rate_rps": rate,
                     "requests": spans[-1][0], "replay_s": spans[-1][1],
                     "slo_attainment": probe.slo_attainment, "lost": probe.lost,
                     "ttft_p99_ms": probe.ttft_p99_ms, "tpot_p99_ms": probe.tpot_p99_ms})
    return Confirmation(load_rps=need.load_rps, slo_attainment=met / total if total else 0.0,
                        promised_attainment=slo_attainment, lost=lost, per_option=rows,
                        num_requests=min((n for n, _ in spans), default=len(ref)),
                        replay_s=min((d for _, d in spans), default=0.0))


def capacity_report(model: ModelSpec, trace: Workload, prices: GpuPrices, *, load_rps: float, slo_ttft_ms: float,
                    slo_tpot_ms: float, dtype: str = "bf16", context_p95_tokens: int | None = None,
                    output_p95_tokens: int | None = None, reserve_fraction: float = DEFAULT_RESERVE,
                    gpu_types: Sequence[str] | None = None, confirm_requests: int | None = 1000,
                    instance_sizes: int = DEFAULT_INSTANCE_SIZES,
                    progress: Callable[[str], None] | None = None) -> CapacityPlan:
    """The whole path of the module docstring, from a trace and a load to a confirmed plan.

    Args:
        trace: gives the mean prompt / output lengths, the P95s (unless given) and the replay.
        context_p95_tokens / output_p95_tokens: override the trace's P95s (tokens).
        confirm_requests: requests of the trace replayed per instance in the simulator (None: skip).

    Raises:
        InputError: a bad figure (named); with ``confirm_requests``, a trace of fewer than
            :data:`~flexpipe_dag.planner.operating.MIN_REFERENCE_REQUESTS` requests the model can serve (a
            replay of a handful of requests confirms nothing). InfeasibleError: no type serves the load within the SLO.
    """
    figures = trace_figures(trace, model)
    if confirm_requests is not None and len(figures.served) < MIN_REFERENCE_REQUESTS:
        raise InputError(trace.source or trace.name, "requests",
                         f"the trace has {len(figures.served)} request(s) the model can serve; confirming a plan in the "
                         f"simulator needs at least {MIN_REFERENCE_REQUESTS} (a replay of a handful of requests is no "
                         f"confirmation); give a longer trace, or --no-simulate")
    context = context_p95_tokens if context_p95_tokens is not None else figures.context_p95_tokens
    if model.max_context_tokens and context > model.max_context_tokens:
        raise InputError(None, "--context-p95", f"{context} tokens exceeds {model.name}'s max context of "
                                                f"{model.max_context_tokens}; expected 1..{model.max_context_tokens}")
    output = output_p95_tokens if output_p95_tokens is not None else min(figures.output_p95_tokens, context)
    need = capacity_need(model, dtype=dtype, load_rps=load_rps, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                         context_p95_tokens=context, output_p95_tokens=output, reserve_fraction=reserve_fraction)
    plan = plan_capacity(model, need, figures.workload, prices, gpu_types, instance_sizes=instance_sizes,
                         progress=progress, reference=figures.served)
    if confirm_requests is not None and plan.mix is not None:
        if progress:
            progress("replaying the trace in the simulator")
        plan = confirm_plan(plan, figures.served, num_requests=confirm_requests,
                            max_context_tokens=model.max_context_tokens)
        for _ in range(MAX_REFINEMENTS):
            if plan.all_confirmed():
                break
            if progress:
                progress("a replay missed the promise: measuring envelopes in the simulator")
            plan = refine_with_simulator(plan, figures.served, num_requests=confirm_requests,
                                         max_context_tokens=model.max_context_tokens)
    return plan


def refine_with_simulator(plan: CapacityPlan, reference: Workload, *, num_requests: int,
                          max_context_tokens: int | None = None) -> CapacityPlan:
    """One round of correcting the plan by measurement when its replay missed the promise.

    Each pipeline option of a fleet (the mix or a type alone) whose replay missed (attainment under
    the promise, or a request lost) gets its envelope *measured* in the simulator
    (:func:`~flexpipe_dag.planner.envelope.measure_envelope`: bisection on the rate, the same replay
    as the confirmation) and keeps the lower of the analytic and measured figures; every type's fleet
    and the mix are re-solved (the same exact ILP) and replayed again. The replay that failed ran at
    a rate the measured envelope cannot reach, so each round lowers at least one envelope.

    Raises:
        InfeasibleError: with the measured envelopes no type serves the load.
        InputError: the plan has no confirmation (nothing to refine) or a degenerate trace.
    """
    from flexpipe_dag.planner.envelope import measure_envelope

    need = plan.need
    fleets = [(plan.mix, plan.confirmation)] + [(t.mix, t.confirmation) for t in plan.types]
    if plan.confirmation is None or plan.mix is None:
        raise InputError(None, "confirmation", "refining needs a plan replayed in the simulator")
    config = SimConfig(max_context_tokens=max_context_tokens)
    replaced: dict[int, InstanceOption] = {}
    notes = list(plan.notes)
    failing = {id(option): option for fleet, conf in fleets if fleet is not None and conf is not None
               for (option, _), row in zip(fleet.instances, conf.per_option)
               if row["slo_attainment"] < conf.promised_attainment or row["lost"]}
    for option in failing.values():
        env = measure_envelope(option.gear, option.timing, reference, slo_ttft_ms=need.slo_ttft_ms,
                               slo_tpot_ms=need.slo_tpot_ms, attainment=plan.slo_attainment,
                               num_requests=num_requests, start_rps=option.rps_max, sim_config=config)
        rps = min(option.rps_max, env.rps_max)
        replaced[id(option)] = dataclasses.replace(option, rps_max=rps)
        notes.append(f"the simulator measured the {option.cards} x {option.gpu_type} pipeline's envelope at "
                     f"{env.rps_max:.3f} req/s (analytic {option.rps_max:.3f}); the plan was re-solved with {rps:.3f}")
    types = []
    for t in plan.types:
        options = [replaced.get(id(o), o) for o in t.options]
        if options == t.options:
            types.append(t)
            continue
        fleet = cheapest_mix(options, load_rps=need.load_rps, kv_need_tokens=need.kv_need_tokens,
                             reserve_fraction=need.reserve_fraction)
        types.append(dataclasses.replace(t, options=options, mix=fleet, note="" if fleet else "no fleet of this type "
                                         "meets the SLO with the envelopes the simulator measured"))
    new_mix = cheapest_mix([o for t in types for o in t.options], load_rps=need.load_rps,
                           kv_need_tokens=need.kv_need_tokens, reserve_fraction=need.reserve_fraction)
    if new_mix is None:
        raise InfeasibleError(f"with the envelopes the simulator measured, no fleet of {', '.join(t.gpu_type for t in types)} "
                              f"serves {need.load_rps:g} req/s within TTFT {need.slo_ttft_ms:g} ms and TPOT "
                              f"{need.slo_tpot_ms:g} ms")
    refined = dataclasses.replace(plan, types=types, mix=new_mix, notes=notes, confirmation=None)
    return confirm_plan(refined, reference, num_requests=num_requests, max_context_tokens=max_context_tokens)


def confirm_plan(plan: CapacityPlan, reference: Workload, *, num_requests: int,
                 max_context_tokens: int | None = None) -> CapacityPlan:
    """``plan`` with its mix and every type's fleet replayed by :func:`confirm_mix` (a fleet replayed once).

    Raises:
        InputError: a degenerate trace, or an option not planned by :func:`plan_capacity`.
    """
    done: dict[tuple[tuple[int, int], ...], Confirmation] = {}

    def replay(mix: Mix) -> Confirmation:
        key = tuple((id(o), k) for o, k in mix.instances)
        if key not in done:
            done[key] = confirm_mix(mix, plan.need, reference, num_requests=num_requests,
                                    slo_attainment=plan.slo_attainment, max_context_tokens=max_context_tokens)
        return done[key]

    types = [dataclasses.replace(t, confirmation=replay(t.mix)) if t.mix is not None else t for t in plan.types]
    out = dataclasses.replace(plan, types=types)
    out.confirmation = replay(plan.mix) if plan.mix is not None else None
    return out
