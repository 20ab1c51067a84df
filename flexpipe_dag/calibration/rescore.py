"""Re-score gears with a calibrated cost model and say which estimates moved by more than a margin.

For each gear the planner's own estimator (:func:`~flexpipe_dag.planner.estimate.estimate_plan`) is run
twice on the gear's fixed stages: with the prior cost model (the profile and the calibration's prior)
and with the calibrated one. A gear whose throughput, TTFT / TPOT or any stage's decode-step time moves
by more than ``margin`` (relative) is flagged; its updated copy carries the new estimate, stage times
and an envelope scaled to the new capacity. The planner is also re-run on the calibrated model: when the
latency / balanced / throughput picks change layout (devices, layer split or micro-batch), the
candidate gears must be re-planned. The Dagster wiring (re-materialising ``candidate_gears`` /
``gear_evaluations``) acts on :attr:`RescoreResult.needs_replan`.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from flexpipe_dag.calibration.calibrate import Calibration
from flexpipe_dag.core.cluster import ClusterProfile
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import Gear, GearEstimate
from flexpipe_dag.planner.cost_model import CostModel
from flexpipe_dag.planner.estimate import PlanEstimate, estimate_plan
from flexpipe_dag.planner.gears import plan_gears
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.planner.search import FIRST, LAST, MIDDLE, SINGLE, PipelinePlan, PipelineSearch
from flexpipe_dag.planner.workload import PlanWorkload

#: A gear's configuration: ``(micro_batch_size, ((device_ids, num_layers), ...))``.
Layout = tuple[int, tuple[tuple[tuple[str, ...], int], ...]]

METRICS: tuple[str, ...] = ("throughput_rps", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def plan_from_gear(search: PipelineSearch, gear: Gear) -> PipelinePlan:
    """The search's view of a fixed gear (its devices, layer split and micro-batch), priced by ``search``.

    Raises:
        InputError: the gear names a device the search's cluster lacks.
    """
    known = {d.device_id for d in search.cm.cluster.devices}
    for st in gear.stages:
        for d in st.device_ids:
            if d not in known:
                raise InputError(gear.gear_id, f"stages[{st.stage_index}].device_ids", f"device {d!r} is not in the cluster")
    S = gear.num_stages
    roles = [SINGLE] if S == 1 else [FIRST] + [MIDDLE] * (S - 2) + [LAST]
    b = gear.micro_batch_size
    busy = [float(search.tables(st.device_ids[0], b, st.replicas).busy_ms[r, st.num_layers])
            for st, r in zip(gear.stages, roles)]
    links = [search.link_busy_ms(a.device_ids[0], c.device_ids[0]) for a, c in zip(gear.stages, gear.stages[1:])]
    return PipelinePlan(b, [list(st.device_ids) for st in gear.stages], [st.num_layers for st in gear.stages],
                        busy, links, origin="gear")


def stage_decode_ms(search: PipelineSearch, gear: Gear) -> list[float]:
    """Per stage, one decode step of a full micro-batch at the workload's mean context, ms (the gear's ``est_stage_ms``)."""
    S = gear.num_stages
    roles = [SINGLE] if S == 1 else [FIRST] + [MIDDLE] * (S - 2) + [LAST]
    return [float(search.tables(st.device_ids[0], gear.micro_batch_size, st.replicas).decode_ms[r, st.num_layers])
            for st, r in zip(gear.stages, roles)]


@dataclass(frozen=True)
class GearRescore:
    """One gear before and after a calibration.

    Attributes:
        before / after: ``{metric: value}`` for :data:`METRICS` (rates per second, times in ms).
        stage_ms_before / stage_ms_after: decode-step time per stage, ms.
        max_change: largest relative change over metrics and stage times.
        exceeds_margin: ``max_change > margin``.
        updated: the gear with the calibrated estimate, stage times and envelope.
        message: one sentence for people.
    """

    gear_id: str
    kind: str
    before: dict[str, float]
    after: dict[str, float]
    stage_ms_before: list[float]
    stage_ms_after: list[float]
    max_change: float
    exceeds_margin: bool
    updated: Gear
    message: str


@dataclass(frozen=True)
class RescoreResult:
    """All gears re-scored, and whether the planner's picks changed.

    Attributes:
        margin: the relative change that counts.
        gears: per given gear.
        planned_before / planned_after: the planner's operating gears on the prior / calibrated model.
        choice_changes: ``{kind: (layout_before, layout_after)}`` for kinds whose pick changed, where a
            layout is ``(micro_batch, ((device_ids, num_layers), ...))``.
    """

    margin: float
    gears: list[GearRescore]
    planned_before: list[Gear] = field(default_factory=list)
    planned_after: list[Gear] = field(default_factory=list)
    choice_changes: dict[str, tuple[Layout | None, Layout | None]] = field(default_factory=dict)

    @property
    def choice_changed(self) -> bool:
        return bool(self.choice_changes)

    @property
    def needs_replan(self) -> bool:
        """True when candidate gears / evaluations should be re-materialised."""
        return self.choice_changed or any(g.exceeds_margin for g in self.gears)

    def messages(self) -> list[str]:
        out = [g.message for g in self.gears if g.exceeds_margin]
        for kind, (a, b) in self.choice_changes.items():
            out.append(f"the {kind} pick changes: {_layout_text(a)} -> {_layout_text(b)}")
        return out


def layout(gear: Gear) -> Layout:
    """What makes two gears the same configuration: micro-batch and ``(devices, layers)`` per stage."""
    return (gear.micro_batch_size, tuple((tuple(st.device_ids), st.num_layers) for st in gear.stages))


def _layout_text(lay: Layout | None) -> str:
    if lay is None:
        return "none (collapsed)"
    micro_batch_size, stages = lay
    return "[" + ", ".join(f"{'+'.join(d)}:{k}" for d, k in stages) + f"] b={micro_batch_size}"


def _metrics(est: PlanEstimate) -> dict[str, float]:
    return {m: float(getattr(est, m)) for m in METRICS}


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)) or a == 0:
        return math.inf
    return abs(b - a) / abs(a)


def rescore_gears(model: ModelSpec, cluster: ClusterProfile, calibration: Calibration, gears: Sequence[Gear], *,
                  dtype: str | None = None, workload: PlanWorkload | None = None, margin: float = 0.10,
                  replan: bool = True, now: dt.datetime | None = None) -> RescoreResult:
    """Re-score ``gears`` (and, with ``replan``, re-run the planner) on the calibrated cost model.

    Args:
        model, cluster: what the gears were planned for (the *profile*, not the calibrated copy).
        calibration: from :func:`~flexpipe_dag.calibration.calibrate.calibrate` for this cluster.
        dtype: the cost model's dtype (default the calibration's).
        workload: the planning workload (default :class:`PlanWorkload`).
        margin: relative change that flags a gear (0.10 = 10 %).
        replan: also compare the planner's operating picks before / after.

    Raises:
        InputError: a gear names a device the cluster lacks, or ``margin`` is negative.
    """
    if margin < 0:
        raise InputError("rescore", "margin", f"expected >= 0, got {margin}")
    dtype = dtype or calibration.dtype
    workload = workload or PlanWorkload()
    before_cm = CostModel(model, cluster, dtype=dtype, device_overrides=calibration.base_overrides)
    after_cm = calibration.cost_model(model, cluster)
    s_before, s_after = PipelineSearch(before_cm, workload, now), PipelineSearch(after_cm, workload, now)
    out = []
    for g in gears:
        eb = estimate_plan(s_before, plan_from_gear(s_before, g))
        ea = estimate_plan(s_after, plan_from_gear(s_after, g))
        mb, ma = _metrics(eb), _metrics(ea)
        sb, sa = stage_decode_ms(s_before, g), stage_decode_ms(s_after, g)
        change = max([_rel(mb[m], ma[m]) for m in METRICS] + [_rel(a, b) for a, b in zip(sb, sa)])
        # the SLO envelope moves with the estimate; where it is 0 either way (the SLO is out of reach
        # at the workload's assumptions), the capacity ratio scales the gear's envelope
        if eb.rps_at_envelope > 0 and ea.rps_at_envelope > 0:
            ratio = ea.rps_at_envelope / eb.rps_at_envelope
        else:
            ratio = ea.throughput_rps / eb.throughput_rps if eb.throughput_rps > 0 else 1.0
        rps_max = g.rps_max * ratio if math.isfinite(g.rps_max) else g.rps_max
        updated = g.model_copy(update={
            "estimate": GearEstimate(**{m: ma[m] for m in METRICS}, bottleneck_stage=ea.bottleneck_stage),
            "stages": [st.model_copy(update={"est_stage_ms": round(t, 6)}) for st, t in zip(g.stages, sa)],
            "rps_min": min(g.rps_min * ratio, rps_max), "rps_max": rps_max,
            "target_p99_ms": max(1.0, math.ceil(ea.ttft_p99_ms))})
        verb = "sustains" if ma["throughput_rps"] <= mb["throughput_rps"] else "sustains up to"
        msg = (f"gear {g.gear_id} now {verb} {ma['throughput_rps']:.3g} req/s, not {mb['throughput_rps']:.3g}; "
               f"TPOT p50 {ma['tpot_p50_ms']:.3g} ms (was {mb['tpot_p50_ms']:.3g}); stage times "
               + ", ".join(f"{a:.3g}" for a in sa) + " ms (were " + ", ".join(f"{b:.3g}" for b in sb) + ")")
        if math.isfinite(g.rps_max) and ratio < 1:
            msg += f"; its envelope narrows to {updated.rps_min:.3g}..{updated.rps_max:.3g} req/s"
        out.append(GearRescore(g.gear_id, g.kind, mb, ma, sb, sa, change, change > margin, updated, msg))
    planned_before: list[Gear] = []
    planned_after: list[Gear] = []
    changes: dict[str, tuple[Layout | None, Layout | None]] = {}
    if replan:
        planned_before = plan_gears(cluster, model, dtype=dtype, workload=workload, now=now,
                                    device_overrides=calibration.base_overrides)
        planned_after = plan_gears(calibration.calibrated_cluster(cluster), model, dtype=dtype, workload=workload,
                                   now=now, device_overrides=calibration.device_overrides())
        before_by_kind = {g.kind: layout(g) for g in planned_before}
        after_by_kind = {g.kind: layout(g) for g in planned_after}
        for kind in sorted(set(before_by_kind) | set(after_by_kind)):
            a, b = before_by_kind.get(kind), after_by_kind.get(kind)
            if a != b:
                changes[kind] = (a, b)
    return RescoreResult(margin, out, planned_before, planned_after, changes)
