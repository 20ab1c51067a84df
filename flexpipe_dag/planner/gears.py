"""Gears: the planner's latency / balanced / throughput pipelines, the baselines, and the oracle.

All kinds go through one code path: :class:`~flexpipe_dag.planner.search.PipelineSearch` prices a
plan, :func:`~flexpipe_dag.planner.estimate.estimate_plan` estimates it, :func:`to_gear` turns it
into a :class:`~flexpipe_dag.core.gear.Gear`.

Gear objectives over the candidate plans (every micro-batch size x a ladder of bottlenecks from the
least feasible up to memory-only, each built "capacity first" and "speed first", plus replicas):

* ``throughput``: maximise estimated tokens/s (ties: lower idle TPOT);
* ``latency``: minimise idle TPOT (the decode round trip), ties: higher tokens/s;
* ``balanced``: maximise Kleinrock's power, tokens/s / TPOT at the envelope (Kleinrock 1979), among
  plans that differ from the latency and throughput picks and whose tokens/s lies between theirs.

The three operating gears are distinct configurations (stages, devices, micro-batch, in-flight
count). When the cluster leaves no distinct plan for a kind (e.g. one device and one micro-batch
size), that kind *collapses* into another: :func:`plan_gear_set` says so in ``collapsed`` /
``notes`` and :func:`plan_gears` returns only the distinct gears, never one pipeline under two ids.

Baselines: ``uniform`` (layer counts differ by at most 1) and ``parameters`` (DeepSpeed's
``partition_balanced`` over per-layer parameter counts, embedding on layer 0 and LM head on the last)
on the device sequences the search proposes (and all devices in profile order); ``oracle``:
exhaustive over ordered device sequences with the exact DP split, for <= 6 devices and <= 16 layers.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import itertools
import logging
import math
from dataclasses import dataclass

import numpy as np

from flexpipe_dag.core.cluster import ClusterProfile, Device, DtypeChoice, choose_gear_dtype
from flexpipe_dag.core.dtypes import canonical_dtype
from flexpipe_dag.core.errors import InfeasibleError, InputError
from flexpipe_dag.core.gear import OPERATING_KINDS, Gear, GearEstimate, GearKind, StagePlan
from flexpipe_dag.planner.cost_model import CostModel, DeviceOverrides
from flexpipe_dag.planner.envelope_model import estimate_envelope
from flexpipe_dag.planner.estimate import PlanEstimate, estimate_plan, inflight_micro_batches
from flexpipe_dag.planner.model_spec import GIB, ModelSpec
from flexpipe_dag.planner.partition import (
    balanced_partition,
    check_stage_count,
    min_bottleneck_split,
    uniform_partition,
)
from flexpipe_dag.planner.search import FIRST, LAST, MIDDLE, SINGLE, PipelinePlan, PipelineSearch, PlanSignature
from flexpipe_dag.planner.workload import PlanWorkload

log = logging.getLogger(__name__)

ORACLE_MAX_DEVICES = 6
ORACLE_MAX_LAYERS = 16
LADDER_STEPS = 6
#: The latency gear is chosen for this share of the best plan's capacity (the tide's trough).
LOW_LOAD_SHARE = 0.25
#: ``candidate_gears`` adds compact plans sized for the planned concurrency divided by these factors.
COMPACT_CONCURRENCY_DIVISORS: tuple[int, ...] = (2, 4, 8)


@dataclass(frozen=True)
class ScoredPlan:
    """A plan and its estimate."""

    plan: PipelinePlan
    estimate: PlanEstimate


def _score(search: PipelineSearch, plan: PipelinePlan) -> ScoredPlan:
    return ScoredPlan(plan, estimate_plan(search, plan))


def candidate_plans(search: PipelineSearch, num_stages: int | None = None, replicas: bool = True) -> list[ScoredPlan]:
    """Every distinct plan the search proposes over micro-batch sizes and the bottleneck ladder."""
    seen: dict[PlanSignature, ScoredPlan] = {}
    built: set[PlanSignature] = set()
    for micro_batch_size in search.workload.micro_batch_sizes_to_search():
        t_min = (search.min_limit(micro_batch_size) if num_stages is None
                 else _min_limit_forced(search, micro_batch_size, num_stages))
        if t_min is None:
            continue
        cand = search.candidate_limits(micro_batch_size)
        t_max = float(cand[-1])
        ladder = [t_min] if num_stages is not None else sorted(
            {t_min, *np.geomspace(t_min, max(t_max, t_min), LADDER_STEPS).tolist()})
        for limit in ladder:
            for prefer in ("capacity", "speed"):
                for plan in search.construct(micro_batch_size, limit, prefer, num_stages):
                    if plan.signature() in built:
                        continue
                    built.add(plan.signature())
                    for p in ([plan, search.add_replicas(plan)] if replicas else [plan]):
                        if p.signature() not in seen:
                            seen[p.signature()] = _score(search, p)
    return list(seen.values())


def _min_limit_forced(search: PipelineSearch, micro_batch_size: int, num_stages: int) -> float | None:
    cand = search.candidate_limits(micro_batch_size)
    if len(cand) == 0 or not search.construct(micro_batch_size, float(cand[-1]), "capacity", num_stages):
        return None
    lo, hi = 0, len(cand) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if search.construct(micro_batch_size, float(cand[mid]), "capacity", num_stages):
            hi = mid
        else:
            lo = mid + 1
    return float(cand[lo])


def pick(kind: str, scored: list[ScoredPlan], search: PipelineSearch | None = None) -> ScoredPlan:
    """The best plan for ``kind`` (objectives in the module docstring); deterministic tie-breaks.

    ``search`` is needed for ``latency`` (it re-estimates candidates at the low-load point).
    """
    def tie(s: ScoredPlan) -> tuple[int, int, PlanSignature]:
        return (s.plan.num_stages, s.plan.micro_batch_size, s.plan.signature())

    if kind in ("throughput", "uniform", "parameters", "oracle"):
        return min(scored, key=lambda s: (-round(s.estimate.tokens_per_s, 6), s.estimate.tpot_idle_ms, tie(s)))
    if kind == "latency":
        return pick_latency(search, scored)
    if kind == "balanced":
        return min(scored, key=lambda s: (-s.estimate.tokens_per_s / s.estimate.tpot_p50_ms, tie(s)))
    raise InputError(None, "kind", f"unknown gear kind {kind!r}")


def pick_latency(search: PipelineSearch | None, scored: list[ScoredPlan]) -> ScoredPlan:
    """Lowest TPOT P50 (then TTFT P50) at the low-load point ``LOW_LOAD_SHARE`` x the best capacity,
    among plans whose envelope reaches that point."""
    if search is None:
        raise InputError(None, "search", "picking a latency gear needs the search state")
    q_low = LOW_LOAD_SHARE * max(s.estimate.throughput_rps for s in scored)
    able = [s for s in scored if s.estimate.rps_at_envelope >= q_low] or scored

    def key(s: ScoredPlan) -> tuple[float, float, float, int, PlanSignature]:
        e = estimate_plan(search, s.plan, rps=q_low)
        return (round(e.tpot_p50_ms, 6), round(e.ttft_p50_ms, 6), -s.estimate.tokens_per_s,
                s.plan.num_stages, s.plan.signature())

    return min(able, key=key)


# -- baselines -------------------------------------------------------------------------------------
def baseline_sequences(search: PipelineSearch) -> list[list[str]]:
    """Device sequences a baseline user would run: every available device in profile order (the
    DeepSpeed world), then with the smallest-memory device dropped, one at a time."""
    pool = list(search.pool)
    drop_order = sorted(pool, key=lambda d: (d.memory_gib, d.peak_tflops, d.device_id))
    seqs = []
    for n_drop in range(len(pool)):
        dropped = {d.device_id for d in drop_order[:n_drop]}
        seqs.append([d.device_id for d in pool if d.device_id not in dropped])
    return seqs


def baseline_plans(search: PipelineSearch, kind: str, sequences: list[list[str]]) -> list[ScoredPlan]:
    """``uniform`` or ``parameters`` splits over the given device sequences, every micro-batch size.

    Sequences are tried in order and the first one with any feasible split is used (a user drops
    devices only until the model fits).
    """
    L = search.num_layers
    model = search.model
    out = []
    for seq in sequences:
        if len(seq) > L:
            continue
        if kind == "uniform":
            sizes = uniform_partition(L, len(seq))
        elif kind == "parameters":
            weights = [float(model.params_per_layer)] * L
            weights[0] += model.embedding_params
            weights[-1] += model.head_params
            sizes = balanced_partition(weights, len(seq))
        else:
            raise InputError(None, "kind", f"not a baseline kind: {kind!r}")
        for micro_batch_size in search.workload.micro_batch_sizes_to_search():
            plan = search.evaluate_split(micro_batch_size, seq, sizes, kind)
            if plan is not None:
                out.append(_score(search, plan))
        if out:
            return out
    return out


def oracle_plans(search: PipelineSearch) -> list[ScoredPlan]:
    """Exhaustive: every ordered sequence of distinct pool devices x the exact DP split, per micro-batch.

    Interchangeable devices (same profile and links) are enumerated once. No replicas.

    Raises:
        InputError: more than 6 devices or 16 layers.
    """
    L, pool = search.num_layers, [d.device_id for d in search.pool]
    if len(pool) > ORACLE_MAX_DEVICES or L > ORACLE_MAX_LAYERS:
        raise InputError(None, "oracle", f"exhaustive oracle is for <= {ORACLE_MAX_DEVICES} devices and "
                         f"<= {ORACLE_MAX_LAYERS} layers, got {len(pool)} devices and {L} layers")
    out = []
    for micro_batch_size in search.workload.micro_batch_sizes_to_search():
        best: PipelinePlan | None = None
        seen_sig: set[tuple[object, ...]] = set()  # device profiles, then link times
        for s in range(1, min(len(pool), L) + 1):
            for seq in itertools.permutations(pool, s):
                sig = tuple(search.profile(d) for d in seq) + tuple(
                    search.link_busy_ms(a, c) for a, c in zip(seq, seq[1:]))
                if sig in seen_sig:
                    continue
                seen_sig.add(sig)
                links = [search.link_busy_ms(a, c) for a, c in zip(seq, seq[1:])]
                if any(math.isinf(x) for x in links):
                    continue
                roles = [SINGLE] if s == 1 else [FIRST] + [MIDDLE] * (s - 2) + [LAST]
                costs = np.full((s, L + 1, L + 1), np.inf)
                for k, (d, role) in enumerate(zip(seq, roles)):
                    row = search.tables(d, micro_batch_size).busy_ms[role]            # by number of layers
                    diff = np.arange(L + 1)[None, :] - np.arange(L + 1)[:, None]
                    costs[k] = np.where(diff >= 1, row[np.clip(diff, 0, L)], np.inf)
                bottleneck, sizes = min_bottleneck_split(costs, links)
                if not sizes:
                    continue
                if best is None or bottleneck < best.bottleneck_ms - 1e-12:
                    best = search.evaluate_split(micro_batch_size, list(seq), sizes, "oracle")
        if best is not None:
            out.append(_score(search, best))
    return out


# -- gears -----------------------------------------------------------------------------------------
def _gear_id(kind: str, model: ModelSpec, dtype: str, plan: PipelinePlan, cluster_id: str) -> str:
    text = repr((kind, model.name, dtype, cluster_id, plan.signature()))
    return f"{kind}-{plan.num_stages}s-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def to_gear(search: PipelineSearch, kind: GearKind, scored: ScoredPlan, *, rps_min: float = 0.0,
            profile_version: int | None = None) -> Gear:
    """Turn a scored plan into a validated :class:`Gear` (stage times, weight GiB, KV token capacity)."""
    plan = scored.plan
    est = estimate_envelope(search, plan)  # the fixed-point SLO envelope: what the gear promises before simulation
    w, cm, model = search.workload, search.cm, search.model
    S = plan.num_stages
    roles = [SINGLE] if S == 1 else [FIRST] + [MIDDLE] * (S - 2) + [LAST]
    stages, start, kv_caps = [], 0, []
    for i, (ds, k, role) in enumerate(zip(plan.device_ids, plan.sizes, roles)):
        first, last = role in (FIRST, SINGLE), role in (LAST, SINGLE)
        weight = model.stage_weight_bytes(k, first, last, cm.dtype)
        t = search.tables(ds[0], plan.micro_batch_size, len(ds))
        ws = max(plan.micro_batch_size, w.prefill_chunk_tokens) * model.activation_workspace_bytes_per_token(cm.dtype)
        free_kv = t.usable_bytes - weight - ws
        kv_tokens = int(free_kv // (model.kv_bytes_per_token_per_layer(cm.dtype) * k)) * len(ds)
        kv_caps.append(kv_tokens)
        stages.append(StagePlan(stage_index=i, layer_start=start, layer_end=start + k, device_ids=list(ds),
                                est_stage_ms=round(float(t.decode_ms[role, k]), 6), weight_gib=round(weight / GIB, 4),
                                kv_capacity_tokens=kv_tokens))
        start += k
    rps_max = est.rps_at_envelope
    estimate = GearEstimate(
        throughput_rps=est.throughput_rps, tokens_per_s=est.tokens_per_s, ttft_p50_ms=est.ttft_p50_ms,
        ttft_p99_ms=est.ttft_p99_ms, tpot_p50_ms=est.tpot_p50_ms, tpot_p99_ms=est.tpot_p99_ms,
        bottleneck_stage=est.bottleneck_stage)
    dtype = gear_plan_dtype(search, plan)
    return Gear(
        gear_id=_gear_id(kind, model, dtype, plan, cm.cluster.cluster_id), kind=kind, model_name=model.name,
        dtype=dtype, num_layers=model.num_layers, stages=stages, micro_batch_size=plan.micro_batch_size,
        max_inflight_micro_batches=inflight_micro_batches(plan, w.concurrency),
        kv_capacity_tokens=min(kv_caps), rps_min=min(rps_min, rps_max), rps_max=rps_max,
        target_p99_ms=max(1.0, math.ceil(est.ttft_p99_ms)), estimate=estimate, cluster_id=cm.cluster.cluster_id,
        profile_version=profile_version)


def gear_plan_dtype(search: PipelineSearch, plan: PipelinePlan) -> str:
    """The dtype one gear runs in: the search's, except that under the bf16 -> fp16 fallback a gear
    whose devices all have bf16 stays bf16 (the fallback is for the gears that use devices without it)."""
    allowed = search.bf16_device_ids
    if allowed is not None and all(i in allowed for ds in plan.device_ids for i in ds):
        return "bf16"
    return search.cm.dtype


def gear_dtype(cluster: ClusterProfile, dtype: str, workload: PlanWorkload, now: dt.datetime | None = None) -> DtypeChoice:
    """The dtype gears run in on ``cluster`` when ``dtype`` is requested (devices usable for the
    workload's minimum residence; rule: :func:`~flexpipe_dag.core.cluster.choose_gear_dtype`).

    Raises:
        InputError: as :func:`~flexpipe_dag.core.cluster.choose_gear_dtype`.
    """
    at = now or cluster.measured_at
    usable = [d for d in cluster.devices if d.available_for_s(at) >= workload.min_residence_s]
    return choose_gear_dtype(usable, dtype, workload.bf16_fallback)


def make_search(cluster: ClusterProfile, model: ModelSpec, *, dtype: str = "bf16",
                workload: PlanWorkload | None = None, now: dt.datetime | None = None,
                device_overrides: DeviceOverrides | None = None) -> PipelineSearch:
    """Cost model + search state for ``model`` on ``cluster``.

    The gear's dtype is settled first (:func:`~flexpipe_dag.core.cluster.choose_gear_dtype` over the
    devices available for the workload's minimum residence): bf16 on a fleet with devices lacking it
    becomes fp16, or leaves them out, or is refused, by ``workload.bf16_fallback``; what was done is
    logged (INFO) and kept in the search's ``notes``.

    Raises:
        InputError: bad dtype; bf16 refused (``bf16_fallback="refuse"``) or no device left.
    """
    workload = workload or PlanWorkload()
    choice = gear_dtype(cluster, dtype, workload, now)
    notes = []
    if choice.note:
        notes.append(choice.note)
        log.info("plan %s on %s: %s", model.name, cluster.cluster_id, choice.note)
    cm = CostModel(model, cluster, dtype=choice.dtype, device_overrides=device_overrides)
    search = PipelineSearch(cm, workload, now, exclude_device_ids=choice.excluded_device_ids, notes=notes)
    if choice.dtype == "fp16" and canonical_dtype(dtype, "planning", "dtype") == "bf16":
        # fp16 prices as bf16 (same bytes, same tensor-core rate): a gear on bf16 devices only keeps bf16
        search.bf16_device_ids = frozenset(d.device_id for d in cluster.devices if not d.lacks_bf16)
    return search


def plan_kind(search: PipelineSearch, kind: str, num_stages: int | None = None) -> ScoredPlan:
    """The best plan of one kind (an operating kind, a baseline or the oracle).

    Raises:
        InfeasibleError: no plan fits (the message names the binding constraint).
    """
    if num_stages is not None:
        check_stage_count(search.num_layers, num_stages)
        if num_stages > len(search.pool):
            raise InfeasibleError(f"{num_stages} stages need {num_stages} devices, {len(search.pool)} are available")
    if kind == "oracle":
        scored = oracle_plans(search)
    elif kind in ("uniform", "parameters"):
        seqs = baseline_sequences(search)
        if num_stages is not None:
            seqs = [s[:num_stages] for s in seqs if len(s) >= num_stages][:1]
        scored = baseline_plans(search, kind, seqs)
        if not scored:
            raise InfeasibleError(f"no {kind} split of {search.num_layers} layers fits any baseline device sequence "
                                  f"({search.explain_infeasible()})")
    else:
        scored = candidate_plans(search, num_stages)
    if not scored:
        raise InfeasibleError(search.explain_infeasible())
    return pick(kind, scored, search)


@dataclass(frozen=True)
class GearSet:
    """The planner's operating gears and how the three kinds map onto them.

    Attributes:
        gears: distinct gears, ordered latency, balanced, throughput (kinds that collapsed are absent).
        collapsed: ``{kind: kind_it_collapsed_into}`` for kinds with no distinct plan of their own.
        notes: one sentence per collapse, for logs and asset metadata.
    """

    gears: list[Gear]
    collapsed: dict[str, str]
    notes: list[str]

    def gear_for(self, kind: str) -> Gear:
        """The gear serving ``kind`` (the one it collapsed into, if it did).

        Raises:
            InputError: ``kind`` is not an operating kind.
        """
        if kind not in ("latency", "balanced", "throughput"):
            raise InputError(None, "kind", f"expected latency / balanced / throughput, got {kind!r}")
        kind = self.collapsed.get(kind, kind)
        return next(g for g in self.gears if g.kind == kind)


def _config_key(search: PipelineSearch, s: ScoredPlan) -> tuple[PlanSignature, int]:
    """What makes two plans the same runnable configuration: stages, devices, micro-batch, in flight."""
    return (s.plan.signature(), inflight_micro_batches(s.plan, search.workload.concurrency))


def choose_operating_plans(search: PipelineSearch,
                           scored: list[ScoredPlan]) -> tuple[dict[GearKind, ScoredPlan], dict[str, str]]:
    """Pick distinct latency / balanced / throughput plans (objectives in the module docstring).

    ``throughput`` and ``latency`` are picked on their own objectives; if they are the same
    configuration, ``latency`` collapses into ``throughput``. ``balanced`` is picked among the
    remaining configurations whose tokens/s lies strictly between the two (or, when latency collapsed,
    below throughput's); with none, it collapses into the nearer of the two by tokens/s.

    Returns:
        ``(chosen, collapsed)``: ``chosen[kind]`` for each distinct kind, ``collapsed[kind] = other_kind``.
    """
    thr = pick("throughput", scored, search)
    lat = pick("latency", scored, search)
    chosen: dict[GearKind, ScoredPlan] = {"throughput": thr}
    collapsed: dict[str, str] = {}
    if _config_key(search, lat) == _config_key(search, thr):
        collapsed["latency"] = "throughput"
    else:
        chosen["latency"] = lat
    lo = lat.estimate.tokens_per_s if "latency" in chosen else -math.inf
    hi = thr.estimate.tokens_per_s
    taken = {_config_key(search, p) for p in chosen.values()}
    between = [s for s in scored if _config_key(search, s) not in taken
               and lo * (1 + 1e-6) < s.estimate.tokens_per_s < hi * (1 - 1e-6)]
    if between:
        chosen["balanced"] = pick("balanced", between, search)
    else:
        near = "latency" if "latency" in chosen and abs(hi - (2 * lo + hi) / 3) > abs(lo - (2 * lo + hi) / 3) else "throughput"
        collapsed["balanced"] = near
    return chosen, collapsed


def plan_gear_set(cluster: ClusterProfile, model: ModelSpec, *, dtype: str = "bf16", context_p95_tokens: int = 4096,
                  concurrency: int = 64, now: dt.datetime | None = None, min_residence_s: float = 600.0,
                  workload: PlanWorkload | None = None, profile_version: int | None = None,
                  device_overrides: DeviceOverrides | None = None, replicas: bool = True) -> GearSet:
    """Plan the distinct operating gears for ``model`` on ``cluster`` (arguments as :func:`plan_gears`).

    Envelopes here are the analytic ones (see :func:`plan_gears`); replace them with simulated ones
    with :func:`flexpipe_dag.planner.envelope.refine_envelopes`.

    Raises:
        InfeasibleError: the model cannot be placed (binding constraint named).
        InputError: bad dtype or workload values.
    """
    workload = workload or PlanWorkload(context_p95_tokens=context_p95_tokens, concurrency=concurrency,
                                        min_residence_s=min_residence_s)
    search = make_search(cluster, model, dtype=dtype, workload=workload, now=now, device_overrides=device_overrides)
    scored = candidate_plans(search, replicas=replicas)
    if not scored:
        raise InfeasibleError(search.explain_infeasible())
    chosen, collapsed = choose_operating_plans(search, scored)
    gears: dict[str, Gear] = {k: to_gear(search, k, chosen[k], profile_version=profile_version) for k in chosen}
    prev_max = None
    for kind in sorted(gears, key=lambda k: (gears[k].rps_max, k)):
        if prev_max is not None:
            gears[kind] = gears[kind].model_copy(update={"rps_min": min(0.7 * prev_max, gears[kind].rps_max)})
        prev_max = gears[kind].rps_max
    notes = [f"{kind} collapses into {into} ({gears[into].gear_id}): no distinct configuration of its own on "
             f"{len(search.usable)} usable device(s) for micro-batches {workload.micro_batch_sizes_to_search()}"
             for kind, into in collapsed.items()]
    ordered = [gears[k] for k in ("latency", "balanced", "throughput") if k in gears]
    return GearSet(ordered, collapsed, notes)


def plan_gears(cluster: ClusterProfile, model: ModelSpec, *, dtype: str = "bf16", context_p95_tokens: int = 4096,
               concurrency: int = 64, now: dt.datetime | None = None, min_residence_s: float = 600.0,
               workload: PlanWorkload | None = None, profile_version: int | None = None,
               device_overrides: DeviceOverrides | None = None, replicas: bool = True) -> list[Gear]:
    """Plan the latency, balanced and throughput gears for ``model`` on ``cluster``.

    Args:
        dtype: weight dtype. context_p95_tokens / concurrency: the KV pool each gear must hold.
        now: availability windows are measured from here (default: the profile's ``measured_at``).
        min_residence_s: devices leaving sooner are not used.
        workload: full assumptions (overrides the three workload arguments above when given).
        device_overrides: per-device efficiency factors (see :class:`CostModel`).
        replicas: allow data-parallel replicas of a bottleneck stage (False for a runtime without them).

    Returns:
        The distinct gears in the order latency, balanced, throughput: three where the cluster allows
        three configurations, fewer when a kind collapses into another (:func:`plan_gear_set` names
        which). Each carries its analytic estimate and envelope: ordered by capacity, each gear's
        ``rps_min`` is 70 % of the next-smaller gear's ``rps_max`` (overlap for hysteresis), the
        smallest starts at 0. For envelopes measured in the simulator, pass the result to
        :func:`flexpipe_dag.planner.envelope.refine_envelopes`.

    Raises:
        InfeasibleError: the model cannot be placed (binding constraint named).
        InputError: bad dtype or workload values.
    """
    return plan_gear_set(cluster, model, dtype=dtype, context_p95_tokens=context_p95_tokens, concurrency=concurrency,
                         now=now, min_residence_s=min_residence_s, workload=workload,
                         profile_version=profile_version, device_overrides=device_overrides,
                         replicas=replicas).gears


def candidate_gears(cluster: ClusterProfile, model: ModelSpec, *, dtype: str = "bf16", context_p95_tokens: int = 4096,
                    concurrency: int = 64, now: dt.datetime | None = None, min_residence_s: float = 600.0,
                    workload: PlanWorkload | None = None, profile_version: int | None = None,
                    device_overrides: DeviceOverrides | None = None, max_candidates: int = 8,
                    compact: bool = True, replicas: bool = True) -> list[Gear]:
    """A shortlist of distinct configurations for scoring in the simulator (``kind="manual"``).

    The three analytic picks come first, then, alternating, each device layout's best plan (layouts and
    their plans ranked by the analytic SLO envelope, then estimated tokens/s; a layout is the layer split
    and each stage's devices up to interchangeable ones, :func:`_layout_key`) and the lowest idle TPOT among the
    rest whose estimated capacity is at least ``LOW_LOAD_SHARE`` of the best, until ``max_candidates``;
    then the highest-tokens/s plan on the fewest devices any plan uses, if the cap cut it (one more).
    Ids are ``candidate-<stages>s-<hash>``.
    :func:`flexpipe_dag.planner.envelope.select_operating_gears` picks and relabels the operating
    gears from it.

    Compact candidates (``compact=True``, default): every plan above must hold ``concurrency``
    sequences of ``context_p95_tokens`` in its KV pool, which on small cards takes many devices
    (Llama-2-7B at the default 64 x 4096 tokens needs ~128 GiB of KV, 7+ 16-32 GB devices). A
    trough holds fewer sequences in flight, so for the concurrency divided by each of
    ``COMPACT_CONCURRENCY_DIVISORS`` the plan on the fewest devices (ties: higher estimated
    tokens/s, lower idle TPOT) is appended when it uses fewer devices than every gear already
    listed (at most ``len(COMPACT_CONCURRENCY_DIVISORS)`` more, beyond ``max_candidates``). Its
    gear's KV pool is still all the memory its devices have left, and the simulator measures its
    envelope with that pool (preemptions and rejections included), so a compact gear is picked only
    for the load it actually holds.

    ``replicas=False`` proposes no stage replicas (a runtime without them).

    Raises:
        InfeasibleError / InputError: as :func:`plan_gears`.
    """
    workload = workload or PlanWorkload(context_p95_tokens=context_p95_tokens, concurrency=concurrency,
                                        min_residence_s=min_residence_s)
    search = make_search(cluster, model, dtype=dtype, workload=workload, now=now, device_overrides=device_overrides)
    scored = candidate_plans(search, replicas=replicas)
    if not scored:
        raise InfeasibleError(search.explain_infeasible())
    chosen, _ = choose_operating_plans(search, scored)
    picks: list[ScoredPlan] = [chosen[k] for k in OPERATING_KINDS if k in chosen]
    # each layout's best form, layouts ranked by their analytic SLO envelope: by raw tokens/s, 7-stage lab
    # plans through the T4s (17 req/s unconstrained, 5 within the SLO) took the slots, and the 2 x A100
    # micro-batch-32 plan (8.8 req/s within the SLO) was cut
    envelope_rps = {id(sp): estimate_envelope(search, sp.plan).rps_at_envelope for sp in scored}
    devices = {d.device_id: d for d in search.usable}
    by_layout: dict[tuple[object, ...], ScoredPlan] = {}
    for sp in sorted(scored, key=lambda x: (-envelope_rps[id(x)], -x.estimate.tokens_per_s, x.estimate.tpot_idle_ms,
                                            x.plan.signature())):
        by_layout.setdefault(_layout_key(devices, sp.plan), sp)
    floor = LOW_LOAD_SHARE * max(x.estimate.throughput_rps for x in scored)
    fast = sorted((x for x in scored if x.estimate.throughput_rps >= floor),
                  key=lambda x: (x.estimate.tpot_idle_ms, -x.estimate.tokens_per_s, x.plan.signature()))
    for a, b in itertools.zip_longest(by_layout.values(), fast):
        picks += [x for x in (a, b) if x is not None]
    out: list[Gear] = []
    listed: set[PlanSignature] = set()
    seen: set[tuple[PlanSignature, int]] = set()
    for sp in picks:
        key = _config_key(search, sp)
        if key in seen:
            continue
        seen.add(key)
        listed.add(sp.plan.signature())
        out.append(_candidate(search, sp, profile_version))
        if len(out) >= max_candidates:
            break
    # the trough gear's best form: the highest-tokens/s plan on the fewest devices any plan uses, when the
    # cap cut it (two CPU workers: five 2-worker plans and a low-TPOT, micro-batch-4 1-worker one were
    # listed; the 1-worker plan at micro-batch 16, with twice its envelope, was not)
    def n_devices(sp: ScoredPlan) -> int:
        return sum(len(ds) for ds in sp.plan.device_ids)

    fewest = min(n_devices(sp) for sp in scored)
    small = min((sp for sp in scored if n_devices(sp) == fewest),
                key=lambda sp: (-sp.estimate.tokens_per_s, sp.estimate.tpot_idle_ms, sp.plan.signature()))
    if _config_key(search, small) not in seen:
        listed.add(small.plan.signature())
        out.append(_candidate(search, small, profile_version))
    if compact:  # a plan cut off by max_candidates above is not listed: its compact form may be
        out += _compact_candidates(cluster, model, dtype, workload, now, device_overrides, profile_version,
                                   fewest_devices=min(len(g.device_ids) for g in out),
                                   signatures=listed, replicas=replicas)
    return out


def _layout_key(devices: dict[str, Device], plan: PipelinePlan) -> tuple[object, ...]:
    """A plan's layout up to interchangeable devices: per stage, in order, its layer count and its devices
    (looked up in ``devices``, by id) as (host, model) pairs, sorted. Two A100s of one host swapped between
    stages are one layout."""
    return tuple((n, tuple(sorted((devices[i].node_id, devices[i].model_name) for i in ids)))
                 for ids, n in zip(plan.device_ids, plan.sizes))


def _candidate(search: PipelineSearch, sp: ScoredPlan, profile_version: int | None) -> Gear:
    """``sp`` as a candidate gear (``kind="manual"``, id ``candidate-<stages>s-<hash>``)."""
    g = to_gear(search, "manual", sp, profile_version=profile_version)
    return g.model_copy(update={"gear_id": "candidate" + g.gear_id[len("manual"):]})


def _compact_candidates(cluster: ClusterProfile, model: ModelSpec, dtype: str, workload: PlanWorkload,
                        now: dt.datetime | None, device_overrides: DeviceOverrides | None,
                        profile_version: int | None, *, fewest_devices: int,
                        signatures: set[PlanSignature], replicas: bool = True) -> list[Gear]:
    """The fewest-device plan for each reduced concurrency (see :func:`candidate_gears`), as candidate gears.

    Only plans on fewer devices than ``fewest_devices`` (and than the previous compact one) are
    kept; a reduced concurrency with no feasible plan is skipped.
    """
    out: list[Gear] = []
    seen_concurrency = {workload.concurrency}
    for divisor in COMPACT_CONCURRENCY_DIVISORS:
        concurrency = max(1, workload.concurrency // divisor)
        if concurrency in seen_concurrency:
            continue
        seen_concurrency.add(concurrency)
        search = make_search(cluster, model, dtype=dtype, workload=dataclasses.replace(workload, concurrency=concurrency),
                             now=now, device_overrides=device_overrides)
        scored = [s for s in candidate_plans(search, replicas=replicas) if s.plan.signature() not in signatures]
        if not scored:
            continue
        best = min(scored, key=lambda s: (sum(len(ds) for ds in s.plan.device_ids), -round(s.estimate.tokens_per_s, 6),
                                          s.estimate.tpot_idle_ms, s.plan.signature()))
        n_devices = sum(len(ds) for ds in best.plan.device_ids)
        if n_devices >= fewest_devices:
            continue
        fewest_devices = n_devices
        signatures.add(best.plan.signature())
        out.append(_candidate(search, best, profile_version))
    return out


def plan_baseline(cluster: ClusterProfile, model: ModelSpec, kind: GearKind, *, dtype: str = "bf16",
                  workload: PlanWorkload | None = None, now: dt.datetime | None = None,
                  num_stages: int | None = None) -> Gear:
    """One ``uniform`` / ``parameters`` / ``oracle`` gear (or an operating kind) through the same path."""
    search = make_search(cluster, model, dtype=dtype, workload=workload, now=now)
    return to_gear(search, kind, plan_kind(search, kind, num_stages))
