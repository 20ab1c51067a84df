"""The planner's one path from a fleet to operating gears users and the controller can trust.

``flexpipe plan`` and the Dagster ``candidate_gears`` asset both call :func:`plan_operating_gears`,
with the defaults below, so the same fleet, model and SLO give the same gears everywhere:

1. the planning workload (mean prompt and output, P95 context) is read off the reference trace
   under the model's context rule (:func:`~flexpipe_dag.planner.workload.plan_workload_from_trace`);
2. :func:`~flexpipe_dag.planner.gears.candidate_gears` proposes a shortlist of distinct
   configurations, ranked by the analytic estimate (:mod:`~flexpipe_dag.planner.estimate`);
3. each candidate's envelope is *measured* in the simulator at the user's SLO
   (:func:`~flexpipe_dag.planner.envelope.measure_envelope`, probes stop as soon as their verdict
   is certain), and the latency / balanced / throughput gears are chosen by the measured envelopes
   (:func:`~flexpipe_dag.planner.envelope.select_operating_gears`): the gear called "throughput"
   carries the most, by construction;
4. every gear names what its envelope means (:class:`~flexpipe_dag.core.gear.EnvelopeBasis`), and,
   given a load, :func:`recommend_gear` marks the gear to run with its headroom.

Pure: no Dagster, SQL or torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flexpipe_dag.core.cluster import ClusterProfile
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import EnvelopeBasis, Gear
from flexpipe_dag.planner.cost_model import CostModel, DeviceOverrides
from flexpipe_dag.planner.envelope import (
    GearEnvelope,
    SelectionObjective,
    SelectionSettings,
    gear_id_suffix,
    select_operating_gears,
)
from flexpipe_dag.planner.gears import candidate_gears, gear_dtype
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.planner.workload import PlanWorkload
from flexpipe_dag.workload.context import ContextReport
from flexpipe_dag.workload.request import Workload

#: Sequences in flight each gear's KV pool must hold at the P95 context (CLI and Dagster alike).
DEFAULT_CONCURRENCY = 32
#: The trace envelopes are measured on.
DEFAULT_REFERENCE_TRACE = "azure-conv"
#: Requests of the reference trace replayed per envelope probe.
DEFAULT_REFERENCE_REQUESTS = 1000
#: Fewest requests of the reference trace an envelope is measured on (``--requests`` has the same floor).
MIN_REFERENCE_REQUESTS = 50
#: Devices leaving sooner than this are not planned on, seconds.
DEFAULT_MIN_RESIDENCE_S = 600.0
#: The SLO and attainment level envelopes are measured against unless the user gives their own.
DEFAULT_SLO_TTFT_MS = SelectionSettings.slo_ttft_ms
DEFAULT_SLO_TPOT_MS = SelectionSettings.slo_tpot_ms
DEFAULT_ATTAINMENT = SelectionSettings.attainment
#: Largest SLO target a user may give, ms (an hour per token or to the first token is no SLO: larger
#: figures only make envelopes, and the probes sized from them, absurd).
MAX_SLO_MS = 3_600_000.0


@dataclass(frozen=True)
class Recommendation:
    """The gear to run for a given load, and how much room it leaves.

    Attributes:
        gear_id: the recommended gear.
        load_rps: the load asked about, req/s.
        headroom_fraction: ``1 - load / rps_max`` of that gear (negative: the load exceeds it).
        holds: the gear's envelope holds the load (``load <= rps_max``).
        reason: one sentence, for people.
    """

    gear_id: str
    load_rps: float
    headroom_fraction: float
    holds: bool
    reason: str


#: Headroom ``1 - load / rps_max`` a recommended gear should keep: the promise is checked at 80 % of rps_max.
RECOMMENDED_HEADROOM = 0.2


def recommend_gear(gears: Sequence[Gear], load_rps: float) -> Recommendation:
    """The gear to run at ``load_rps``: of those whose measured envelope holds it with at least
    :data:`RECOMMENDED_HEADROOM`, else of those that hold it at all, the one on the fewest devices
    (ties: the lowest TPOT P50, then the most headroom); with none, the largest envelope.

    Fewest devices first because every gear that holds the load meets the same SLO there (that is
    what ``rps_max`` means, :class:`~flexpipe_dag.core.gear.EnvelopeBasis`); the devices it leaves
    free serve offline work. The controller's own entry test adds its hysteresis margin on top.

    Raises:
        InputError: no gears, or a load that is not a finite number >= 0.
    """
    if not gears:
        raise InputError(None, "gears", "no gears to recommend from")
    if not (isinstance(load_rps, int | float) and math.isfinite(load_rps) and load_rps >= 0):
        raise InputError(None, "load_rps", f"got {load_rps!r}; expected a finite rate >= 0 req/s")

    def headroom(g: Gear) -> float:
        if math.isinf(g.rps_max):
            return 1.0
        return 1.0 - load_rps / g.rps_max if g.rps_max > 0 else -math.inf

    def tpot(g: Gear) -> float:
        return g.estimate.tpot_p50_ms if g.estimate is not None else math.inf

    holding = [g for g in gears if load_rps <= g.rps_max]
    roomy = [g for g in holding if headroom(g) >= RECOMMENDED_HEADROOM - 1e-12]
    if holding:
        pool = roomy or holding
        best = min(pool, key=lambda g: (len(g.device_ids), tpot(g), -headroom(g), g.gear_id))
        which = (f"the fewest of the {len(pool)} gear(s) that hold it with {RECOMMENDED_HEADROOM:.0%} headroom"
                 if roomy else f"the fewest of the {len(pool)} gear(s) that hold it (none with "
                                f"{RECOMMENDED_HEADROOM:.0%} headroom)")
        reason = (f"{best.gear_id} holds {load_rps:g} req/s within its envelope (up to {best.rps_max:.3g} req/s) "
                  f"on {len(best.device_ids)} device(s), {which}")
        return Recommendation(best.gear_id, load_rps, headroom(best), True, reason)
    best = max(gears, key=lambda g: (g.rps_max, g.gear_id))
    reason = (f"no gear holds {load_rps:g} req/s: the largest envelope, {best.gear_id}, ends at {best.rps_max:.3g} "
              f"req/s; requests beyond it queue and miss the SLO (add devices, or relax the SLO)")
    return Recommendation(best.gear_id, load_rps, headroom(best), False, reason)


def small_sample_note(basis: EnvelopeBasis, trace_requests: int) -> str | None:
    """A warning when the envelopes were measured on fewer than :data:`DEFAULT_REFERENCE_REQUESTS` requests
    of a trace of ``trace_requests`` that has more, else None (a short trace replayed whole is its own sample).

    Probes are replayed long enough for a backlog to show (:func:`~flexpipe_dag.planner.envelope.probe_length`),
    but a small sample is a few runs of the trace, and which runs sets the envelope. On fleet_small's A10s
    (Llama-3-8B, azure-conv) 400-request samples put the three gears' envelopes 5 %, 42 % and 64 % above
    the 1,000-request ones; those held on 3,000- and 12,000-request replays (attainment 0.966-0.985 at
    the envelope), and 3,000-request samples gave envelopes within 10 % of them. Before this note the
    overstatement was put down to probe length: replaying the 400 requests 3-13 times over, long enough
    for a micro-batch-64 gear's 256 batch slots to fill, still overstated by 10-46 %.
    """
    return small_sample_warning(basis.num_requests, basis.workload, trace_requests,
                                "envelopes were measured on samples of")


def small_sample_warning(num_requests: int, workload: str, trace_requests: int, what: str) -> str | None:
    """:func:`small_sample_note` for any figure replayed on ``num_requests`` requests of ``workload``
    (``trace_requests`` long); ``what`` says what was replayed (``"envelopes were measured on samples of"``,
    ``"the plan was confirmed on replays, per instance, of"``). None when the sample is
    :data:`DEFAULT_REFERENCE_REQUESTS` or more, or the whole trace."""
    if num_requests >= min(DEFAULT_REFERENCE_REQUESTS, trace_requests):
        return None
    return (f"{what} {num_requests} requests of {workload}: a sample under {DEFAULT_REFERENCE_REQUESTS} requests may "
            f"not represent the trace, and envelopes measured on 400 have been up to 64 % above those of "
            f"{DEFAULT_REFERENCE_REQUESTS}; use at least {DEFAULT_REFERENCE_REQUESTS} requests (--requests / "
            "FLEXPIPE_REFERENCE_REQUESTS) before relying on them")


@dataclass(frozen=True)
class OperatingPlan:
    """What :func:`plan_operating_gears` produced.

    Attributes:
        gears: latency, balanced, throughput (a kind with no distinct candidate left out), each with
            its measured envelope and :class:`~flexpipe_dag.core.gear.EnvelopeBasis`.
        envelopes: every candidate's measured envelope with its probes.
        candidate_ids: the candidates' ids, in the order proposed.
        notes: why a kind is missing, and other remarks for people.
        workload: the planning assumptions used (from the trace).
        basis: the SLO, attainment and workload every envelope is measured against.
        recommendation: the gear for ``load_rps``, when a load was given.
        context: what the context rule did to the reference trace, when the caller applied it.
        wall_s: wall time of the whole plan, seconds.
        probes: simulations run (each of ``basis.num_requests`` requests at most).
        analytic_rps_max: each chosen gear's analytic envelope (the estimate's), by gear id, for comparison.
    """

    gears: list[Gear]
    envelopes: list[GearEnvelope]
    candidate_ids: list[str]
    notes: list[str]
    workload: PlanWorkload
    basis: EnvelopeBasis
    recommendation: Recommendation | None = None
    context: ContextReport | None = None
    wall_s: float = 0.0
    probes: int = 0
    analytic_rps_max: dict[str, float] = field(default_factory=dict)


def plan_operating_gears(cluster: ClusterProfile, model: ModelSpec, reference: Workload, *, workload: PlanWorkload,
                         dtype: str = "bf16", settings: SelectionSettings | None = None,
                         objective: SelectionObjective = "speed", load_rps: float | None = None,
                         profile_version: int | None = None, device_overrides: DeviceOverrides | None = None,
                         replicas: bool = True, context_report: ContextReport | None = None,
                         progress: Callable[[str], None] | None = None) -> OperatingPlan:
    """Plan the operating gears of ``model`` on ``cluster`` and measure their envelopes (module doc).

    Args:
        reference: the trace envelopes are measured on (its first ``settings.num_requests`` requests).
        workload: planning assumptions, e.g. :func:`~flexpipe_dag.planner.workload.plan_workload_from_trace`
            of the same trace.
        dtype: weight / KV dtype requested; bf16 on devices without it follows ``workload.bf16_fallback``
            (:func:`~flexpipe_dag.planner.gears.gear_dtype`; the note says what was done).
        settings: SLO, attainment, probe size and tolerances (default :class:`SelectionSettings`).
        objective: ``"speed"`` or ``"devices"`` (:func:`select_operating_gears`).
        load_rps: when given, the gear for this load is recommended (:func:`recommend_gear`).
        device_overrides: per-device calibration factors of the cost model.
        replicas: allow replicas of a hot stage.
        context_report: what the model's context rule did to ``reference`` (its line joins the notes).
        progress: called with a short line as each step starts (for a spinner or a log).

    Returns:
        An :class:`OperatingPlan`.

    Raises:
        InfeasibleError: the model cannot be placed (binding constraint named).
        InputError: bad settings, workload or load (named); a reference of fewer than
            :data:`MIN_REFERENCE_REQUESTS` requests.
    """
    t0 = time.perf_counter()
    settings = settings or SelectionSettings()
    if len(reference) < MIN_REFERENCE_REQUESTS:
        raise InputError(reference.source or reference.name, "requests",
                         f"the trace has {len(reference)} request(s) the model can serve; measuring an envelope "
                         f"needs at least {MIN_REFERENCE_REQUESTS} (a rate read off a handful of arrivals is no promise)")
    say = progress or (lambda _line: None)
    say(f"proposing candidates for {model.name} on {len(cluster.devices)} device(s)")
    choice = gear_dtype(cluster, dtype, workload)
    candidates = candidate_gears(cluster, model, dtype=dtype, workload=workload, profile_version=profile_version,
                                 device_overrides=device_overrides, replicas=replicas)
    cost_model = CostModel(model, cluster, dtype=choice.dtype, device_overrides=device_overrides)
    say(f"measuring {len(candidates)} candidate envelope(s) in the simulator on {reference.name}")
    selection = select_operating_gears(candidates, cost_model, reference, settings, objective)
    basis = EnvelopeBasis(source="simulator", slo_ttft_ms=settings.slo_ttft_ms, slo_tpot_ms=settings.slo_tpot_ms,
                          attainment=settings.attainment, workload=reference.name,
                          num_requests=min(settings.num_requests, len(reference)))
    gears = [g.model_copy(update={"envelope_basis": basis}) for g in selection.gears]
    by_suffix = {gear_id_suffix(c.gear_id): c.rps_max for c in candidates}  # ids keep their hash when relabelled
    analytic = {g.gear_id: by_suffix.get(gear_id_suffix(g.gear_id), math.nan) for g in gears}
    recommendation = recommend_gear(gears, load_rps) if load_rps is not None else None
    notes = [choice.note] if choice.note else []
    if len(reference) < settings.num_requests:
        notes.append(f"the trace has {len(reference)} requests the model can serve: each probe replays all of them, "
                     f"not the {settings.num_requests} asked for (--requests / FLEXPIPE_REFERENCE_REQUESTS)")
    small = small_sample_note(basis, len(reference))
    if small:
        notes.append(small)
    if context_report is not None and context_report.over_context:
        notes.append(context_report.describe(model.name))
    return OperatingPlan(gears=gears, envelopes=selection.envelopes, candidate_ids=[c.gear_id for c in candidates],
                         notes=notes + selection.notes, workload=workload,
                         basis=basis, recommendation=recommendation, context=context_report,
                         wall_s=time.perf_counter() - t0, probes=sum(len(e.probes) for e in selection.envelopes),
                         analytic_rps_max=analytic)
