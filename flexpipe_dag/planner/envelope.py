"""Operating envelopes measured in the simulator: the highest load each gear serves within the SLO.

The planner's analytic estimate (:mod:`~flexpipe_dag.planner.estimate`) ranks plans; the envelope the
controller acts on comes from replaying a real trace through each gear in the discrete-event
simulator (:mod:`flexpipe_dag.sim`), as issue 4's ``gear_evaluations`` asset prescribes.

Method, per gear:

1. ``num_requests`` requests are drawn from across the reference workload (a real trace, e.g.
   Azure conv): runs of :data:`SAMPLE_RUN_REQUESTS` consecutive requests at evenly spaced
   positions (:func:`~flexpipe_dag.workload.transform.sample_chunks`), since a trace's first minutes
   are not its typical ones. The sample is time-compressed
   (:func:`~flexpipe_dag.workload.transform.speedup`) so its mean arrival rate is the probed rate
   ``lambda`` (req/s). Burstiness (inside each run) and lengths stay those of the trace.
2. A probe at ``lambda`` *passes* when at least ``attainment`` (default 0.95) of the requests after
   the first ``warmup_fraction`` (0.25) of arrivals meet both SLOs (TTFT <= ``slo_ttft_ms``, TPOT
   <= ``slo_tpot_ms``) and none is lost (rejected or unfinished). Skipping the warm-up makes a
   growing backlog count: above saturation the queueing delay grows by ``1/mu - 1/lambda`` per
   request, so the later requests miss the TTFT SLO. The resolution this gives is about
   ``slo_ttft_s x mu / n`` above the saturation rate ``mu`` (2 % for 1,000 requests at 10 req/s
   with a 2 s SLO), so a probe at ``lambda`` replays at least ``slo_ttft_s x lambda /``
   :data:`PROBE_RESOLUTION` requests (:func:`probe_reference`: 2,000 at 50 req/s, 10,000 at 250 req/s),
   the trace repeated when it is shorter, up to :data:`MAX_PROBE_REQUESTS`. Before this rule every
   probe replayed ``num_requests`` (1,000): a gear serving 250 req/s was probed for 4 s, too short for
   any backlog to pass a 2 s TTFT SLO, and an 8 x H100 Llama-3-8B instance was promised 251 req/s
   that a 40-s replay shows it holds only up to about 130.
3. A gear on which more requests than the attainment allows miss the SLO even at zero load
   (:func:`zero_load_misses`, no simulation) gets ``rps_max = 0`` at once. Otherwise ``rps_max`` is
   the highest passing rate: from a start rate (the gear's analytic envelope, else its analytic
   throughput, else the trace's own rate) the rate doubles until a probe fails or halves until one passes, then
   bisects until ``(fail - pass) / fail <= rel_tol``. A gear failing even at
   ``start / 2**max_halvings``, or at the slowest replay of the trace (``MIN_SPEEDUP`` x its own
   rate), gets ``rps_max = 0``. The top rate found is then *confirmed* on longer probes, at least
   :data:`CONFIRM_PROBE_S` of arrivals, on two samples of the trace (:data:`CONFIRM_PHASES`); a rate
   passes only on both. When it fails, the confirming probes step down by :data:`CONFIRM_STEP_DOWN`
   until one passes and bisect back up: the short probes find the bracket cheaply, the long ones
   set the promise (near its top a gear takes minutes to fill its seats with long requests).
4. ``target_p99_ms`` is the TTFT P99 (ms) measured at ``rps_max`` and ``estimate`` the
   :class:`~flexpipe_dag.core.gear.GearEstimate` of that probe (throughput, tokens/s, TTFT / TPOT
   P50 / P99, busiest stage).
5. ``rps_min``: gears sorted by ``rps_max``; the smallest starts at 0, each other at
   ``overlap_fraction`` (0.7) x the next-smaller gear's ``rps_max``, so adjacent envelopes overlap and
   the controller's entry / exit thresholds form a hysteresis band.

:func:`select_operating_gears` first screens every candidate at zero load on the whole trace
(:func:`screen_zero_load`) and measures only those that leave queueing at least half the SLO miss
allowance (:data:`MARGINAL_ALLOWANCE_SHARE`); the envelope of a marginal gear is not a promise.

Deterministic (the simulator and the time compression have no randomness) and pure (no Dagster,
SQL or torch). Cost: about ``log2(range / rel_tol) + 2`` simulations of ``num_requests`` requests
per gear, then two confirming ones of :data:`CONFIRM_PROBE_S` (a few more when the top does not hold).
:func:`select_operating_gears` confirms only the gears it chooses: planning the lab fleet took 8.7 s before
the confirmation, 17.9 s confirming every candidate and 14.6 s confirming the chosen (same gears and envelopes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict, runtime_checkable

import numpy as np

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import Gear, GearEstimate
from flexpipe_dag.core.timing import StageTimingModel
from flexpipe_dag.sim.config import SimConfig
from flexpipe_dag.sim.engine import Simulator
from flexpipe_dag.sim.evaluate import estimate_from_result
from flexpipe_dag.sim.results import SimResult, attainment_after_warmup
from flexpipe_dag.workload.request import Request, Workload
from flexpipe_dag.workload.transform import MAX_SPEEDUP, MIN_SPEEDUP, repeat_to, sample_chunks, speedup

if TYPE_CHECKING:
    from typing_extensions import Unpack

TimingSource = Callable[[Gear], StageTimingModel]

#: Consecutive requests per run of a probe's sample of the reference trace (the trace's burstiness
#: is kept inside a run; :func:`~flexpipe_dag.workload.transform.sample_chunks`).
SAMPLE_RUN_REQUESTS = 100
#: A gear that misses the SLO with nothing else running on more than this share of its miss
#: allowance (``1 - attainment``) is *marginal*: queueing may add only the rest, so its envelope
#: swings with the traffic mix. Measured: a Llama-2-70B gear missing 4.0 % of Azure conv at zero load
#: (allowance 5 %) held 0.05-0.15 req/s on four 1,000-request windows; one missing 1.3 % held 0.18-0.24.
MARGINAL_ALLOWANCE_SHARE = 0.5
#: Requests of the reference the zero-load screen reads at most (evenly strided beyond).
SCREEN_MAX_REQUESTS = 50_000


@runtime_checkable
class TimingProvider(Protocol):
    """An object that prices gears, e.g. the planner's :class:`~flexpipe_dag.planner.cost_model.CostModel`."""

    def timings(self, gear: Gear) -> StageTimingModel:
        """A timing model for ``gear``."""
        ...


class ProbeSettings(TypedDict, total=False):
    """The keyword settings of :func:`measure_envelope` that :func:`measure_envelopes` passes on."""

    slo_ttft_ms: float
    slo_tpot_ms: float
    attainment: float
    num_requests: int
    warmup_fraction: float
    rel_tol: float
    start_rps: float | None
    max_doublings: int
    max_halvings: int
    sim_config: SimConfig | None

@dataclass(frozen=True)
class SelectionSettings:
    """How :func:`select_operating_gears` measures and compares candidates.

    Attributes:
        slo_ttft_ms / slo_tpot_ms: the SLO a request must meet, ms.
        attainment: share of (post-warm-up) requests that must meet it for a rate to count as served.
        num_requests: requests of the reference trace replayed per probe.
        rel_tol: bisection tolerance of an envelope (relative); candidates this close tie.
        low_load_share: the low load at which latency is compared, as a share of the best ``rps_max``.
        low_load_requests: requests replayed for that comparison (well below capacity the TPOT P50
            settles within a few hundred requests).
        overlap_fraction: ``rps_min`` of a gear = this x the next-smaller gear's ``rps_max``.
        sim_config: other simulator settings (KV overrides, prefill budget, ...).
    """

    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0
    attainment: float = 0.95
    num_requests: int = 1000
    rel_tol: float = 0.05
    low_load_share: float = 0.25
    low_load_requests: int = 300
    overlap_fraction: float = 0.7
    sim_config: SimConfig | None = None

    def probe_settings(self) -> ProbeSettings:
        """The keyword settings of :func:`measure_envelope` these imply."""
        return {"slo_ttft_ms": self.slo_ttft_ms, "slo_tpot_ms": self.slo_tpot_ms, "attainment": self.attainment,
                "num_requests": self.num_requests, "rel_tol": self.rel_tol, "sim_config": self.sim_config}


#: How :func:`select_operating_gears` fills the three slots: by speed (TPOT, power) or by goodput per device.
SelectionObjective = Literal["speed", "devices"]
SELECTION_OBJECTIVES: tuple[str, ...] = ("speed", "devices")


@dataclass(frozen=True)
class EnvelopeProbe:
    """One simulation of a gear at one offered rate.

    Attributes:
        rate_rps: offered mean arrival rate, req/s.
        slo_attainment: share of measured requests (after the warm-up) meeting both SLOs.
        lost: requests rejected or unfinished.
        ttft_p99_ms / tpot_p99_ms: P99 over the measured requests, ms (NaN if none finished).
        passed: ``slo_attainment >= attainment`` and ``lost == 0``.
        stopped_s: simulated second at which the probe stopped because it had certainly failed
            (``slo_attainment`` is then the best still possible, ``lost`` the rejections so far); None
            when it ran to the end.
    """

    rate_rps: float
    slo_attainment: float
    lost: int
    ttft_p99_ms: float
    tpot_p99_ms: float
    passed: bool
    estimate: GearEstimate = field(repr=False, compare=False)
    stopped_s: float | None = None


@dataclass(frozen=True)
class GearEnvelope:
    """The measured envelope of one gear: ``rps_max``, the TTFT P99 there, and every probe run.

    ``screened``: why the gear was left out unmeasured (:class:`ZeroLoadScreen`), its ``rps_max`` then 0.
    ``confirmed``: ``rps_max`` held on the long probes of module doc step 3; False for a candidate that
    :func:`select_operating_gears` measured on short probes only (its ``rps_max`` then an upper bound).
    """

    gear_id: str
    rps_max: float
    target_p99_ms: float
    estimate: GearEstimate | None
    probes: tuple[EnvelopeProbe, ...]
    screened: str | None = None
    confirmed: bool = True

    def to_dict(self) -> dict[str, Any]:
        """Plain data for asset metadata: envelope plus a probe table."""
        return {"gear_id": self.gear_id, "rps_max": self.rps_max, "target_p99_ms": self.target_p99_ms,
                "screened": self.screened, "confirmed": self.confirmed,
                "estimate": self.estimate.model_dump() if self.estimate else None,
                "probes": [{"rate_rps": p.rate_rps, "slo_attainment": p.slo_attainment, "lost": p.lost,
                            "ttft_p99_ms": p.ttft_p99_ms, "tpot_p99_ms": p.tpot_p99_ms, "passed": p.passed, "stopped_s": p.stopped_s}
                           for p in self.probes]}


def _timing_source(cost_model: TimingProvider | TimingSource) -> TimingSource:
    if isinstance(cost_model, TimingProvider):  # has .timings (a runtime-checkable protocol checks the attribute)
        return cost_model.timings
    if callable(cost_model):
        return cost_model
    raise InputError("refine_envelopes", "cost_model",
                     "expected an object with .timings(gear) (e.g. planner CostModel) or a callable gear -> timing")


#: Resolution of a probe above the saturation rate (module docstring, step 2): the overload share that
#: must push the graded requests' queueing delay past the TTFT SLO within the probe.
PROBE_RESOLUTION = 0.05
#: Seconds of arrivals the probes that confirm a gear's top rate replay at least (module docstring, step 3): a
#: short probe ends before a gear near its top has filled its seats and KV pool with long requests. Measured on
#: the lab fleet (Llama-3-8B, Azure conv, 2 s / 200 ms SLO): 1,000-request probes (88 s) passed a throughput gear
#: at 11.33 req/s on 8 of 8 samples, where 3,000-request probes failed it on 4 of 8 (attainment 0.51-0.71) and
#: passed every sample at 11.0; its latency gear passed at 6.67 on 1,000 requests and failed on 4 of 8 3,000-request
#: samples (0.90-0.94).
CONFIRM_PROBE_S = 300.0
#: Phases of the samples (:func:`~flexpipe_dag.workload.transform.sample_chunks`) a confirming probe runs: a rate
#: passes only on both. Near a gear's top the verdict swings with the sample's mix (the throughput gear above at
#: 11.33 req/s: attainment 0.63-1.00 over samples of 2,600-3,700 requests), and one lucky sample set the envelope.
#: Phase 0.5 is the held-out sample (:func:`holdout_reference`), never probed.
CONFIRM_PHASES = (0.0, 0.25)
#: Factor by which the confirming probes step down from a top that did not hold, before bisecting back up.
CONFIRM_STEP_DOWN = 0.9
#: Most requests one probe replays (bounds its cost: above ``MAX_PROBE_REQUESTS x PROBE_RESOLUTION /
#: slo_ttft_s`` req/s, 625 req/s with a 2 s SLO, the resolution coarsens in proportion).
MAX_PROBE_REQUESTS = 25_000


def probe_length(num_requests: int, rate_rps: float, slo_ttft_ms: float) -> int:
    """Requests a probe at ``rate_rps`` (req/s) replays: at least ``num_requests``, and enough that an overload
    of :data:`PROBE_RESOLUTION` misses the ``slo_ttft_ms`` SLO (``slo_ttft_s x rate / resolution``), at
    most :data:`MAX_PROBE_REQUESTS` (or ``num_requests`` if that is more)."""
    need = math.ceil(slo_ttft_ms / 1000.0 * rate_rps / PROBE_RESOLUTION) if math.isfinite(rate_rps) else num_requests
    return max(num_requests, min(need, MAX_PROBE_REQUESTS))


def probe_reference(reference: Workload, num_requests: int, rate_rps: float,
                    slo_ttft_ms: float, *, min_duration_s: float = 0.0, phase: float = 0.0) -> tuple[Workload, float]:
    """:func:`reference_slice` of :func:`probe_length` requests for a probe at ``rate_rps`` (and at least
    ``rate_rps x min_duration_s``, up to :data:`MAX_PROBE_REQUESTS`), its runs at ``phase``: the trace
    repeated (:func:`~flexpipe_dag.workload.transform.repeat_to`) when it has fewer.

    Raises:
        InputError: as :func:`reference_slice`.
    """
    n = probe_length(num_requests, rate_rps, slo_ttft_ms)
    if min_duration_s > 0 and math.isfinite(rate_rps):
        n = max(n, min(MAX_PROBE_REQUESTS, math.ceil(rate_rps * min_duration_s)))
    if n > num_requests and n > len(reference) >= 2:
        return reference_slice(repeat_to(reference, n), n, phase=phase)
    return reference_slice(reference, n, phase=phase)


def reference_slice(reference: Workload, num_requests: int, *, phase: float = 0.0) -> tuple[Workload, float]:
    """``num_requests`` requests drawn from across ``reference`` (:func:`~flexpipe_dag.workload.transform.sample_chunks`,
    runs of :data:`SAMPLE_RUN_REQUESTS` at ``phase``, default 0) and their mean arrival rate, req/s; the whole of a
    shorter reference.

    Raises:
        InputError: fewer than 2 requests, or all arriving at one instant.
    """
    if num_requests < 2:
        raise InputError(reference.source or reference.name, "num_requests", f"got {num_requests}; expected >= 2")
    ref = (sample_chunks(reference, num_requests, chunk_requests=SAMPLE_RUN_REQUESTS, phase=phase)
           if len(reference) > num_requests else reference)
    if len(ref) < 2 or ref.duration_s <= 0:
        raise InputError(reference.source or reference.name, None,
                         "reference workload needs at least 2 requests at different times to set a rate")
    return ref, (len(ref) - 1) / ref.duration_s


def probe_gear(gear: Gear, timing: StageTimingModel, reference: Workload, native_rps: float, rate_rps: float, *,
               config: SimConfig, attainment: float = 0.95, warmup_fraction: float = 0.25,
               early_stop: bool = True) -> EnvelopeProbe:
    """Simulate ``gear`` on ``reference`` compressed to ``rate_rps`` and grade it (criterion in the module doc).

    With ``early_stop`` (default) the simulation is checked every 1/16 of the trace's duration and
    stopped as soon as the verdict is certain: a request was rejected, or more measured requests
    are certain SLO misses (:meth:`~flexpipe_dag.sim.engine.Simulator.slo_outcome_so_far`) than
    ``1 - attainment`` allows. Overloaded probes, whose queues make them the slowest to simulate,
    stop early; the verdict is the one the full run would give. A stopped probe reports the best
    attainment still possible and the latencies of the requests finished so far.

    Args:
        reference: the (already sliced) reference workload; ``native_rps`` its mean arrival rate.
        rate_rps: offered mean rate, req/s (> 0).
    """
    return _probe(gear, timing, reference, native_rps, rate_rps, config=config, attainment=attainment,
                  warmup_fraction=warmup_fraction, early_stop=early_stop)[0]


def _probe(gear: Gear, timing: StageTimingModel, reference: Workload, native_rps: float, rate_rps: float, *,
           config: SimConfig, attainment: float, warmup_fraction: float,
           early_stop: bool) -> tuple[EnvelopeProbe, SimResult]:
    """:func:`probe_gear` and the simulation result it graded."""
    factor = rate_rps / native_rps
    if not MIN_SPEEDUP <= factor <= MAX_SPEEDUP:  # say it in the trace's terms: nobody asked for a speedup
        why = (f"compress time {factor:.3g}x, beyond {MAX_SPEEDUP:g}x; expected a trace whose requests arrive "
               "closer together (more of them, or a shorter span)" if factor > MAX_SPEEDUP else
               f"stretch time {1 / factor:.3g}x, beyond {1 / MIN_SPEEDUP:g}x; expected a lower rate, or a trace whose "
               "requests arrive further apart")
        raise InputError(reference.source or reference.name, "arrival_s",
                         f"{len(reference)} request(s) arriving at {native_rps:.3g} req/s on average; replaying them "
                         f"at {rate_rps:.3g} req/s would {why}")
    w = speedup(reference, factor)
    sim = Simulator(w, gear, timing, config)
    first, allowed = _measured_window(len(w), warmup_fraction, attainment)
    stopped_s: float | None = None
    misses = rejected = 0
    if early_stop:
        step_s = max(w.duration_s / 16.0, 1e-3)
        while not sim.finished:
            sim.advance(sim.now_s + step_s)
            misses, rejected = sim.slo_outcome_so_far(first)
            if rejected or misses > allowed:
                stopped_s = sim.now_s
                break
    result = sim.result() if early_stop else sim.run()
    df = result.requests
    measured = df.iloc[first:]
    if stopped_s is None:
        lost = int(df["finish_s"].isna().sum())
        share = attainment_after_warmup(df, warmup_fraction)
    else:
        lost = rejected
        share = 1.0 - misses / max(1, len(measured))

    def p99(col: str) -> float:
        v = measured[col].to_numpy(dtype=float)
        v = v[~np.isnan(v)]
        return float(np.percentile(v, 99)) if v.size else math.nan

    probe = EnvelopeProbe(rate_rps=rate_rps, slo_attainment=share, lost=lost, ttft_p99_ms=p99("ttft_ms"),
                          tpot_p99_ms=p99("tpot_ms"), passed=stopped_s is None and share >= attainment and lost == 0,
                          estimate=estimate_from_result(result), stopped_s=stopped_s)
    return probe, result


def _measured_window(n: int, warmup_fraction: float, attainment: float) -> tuple[int, float]:
    """``(first, allowed)``: the first request graded (after the warm-up; all of them when the warm-up
    would leave none) and how many graded requests may miss the SLO for a rate to pass."""
    skip = int(n * warmup_fraction)
    first = skip if n - skip > 0 else 0
    return first, (n - first) * (1.0 - attainment) + 1e-9


def zero_load_misses(gear: Gear, timing: StageTimingModel, reference: Workload, *, slo_ttft_ms: float,
                     slo_tpot_ms: float, first_index: int = 0) -> int:
    """Requests ``first_index..`` of ``reference`` that miss the SLO on ``gear`` even with nothing else running.

    A lower bound needing no simulation: a request's TTFT is at least its prompt's prefill through
    every stage and link, and its TPOT at least one decode step of one sequence at its prompt's
    context through every stage and link (queueing and batch-mates only add; the timing model is
    non-decreasing in tokens, sequences and context). A gear with more such requests than the
    attainment allows meets the SLO at no rate.
    """
    return _zero_load_misses(timing, reference.requests[first_index:], slo_ttft_ms, slo_tpot_ms)


def _zero_load_misses(timing: StageTimingModel, requests: Sequence[Request], slo_ttft_ms: float,
                      slo_tpot_ms: float) -> int:
    """:func:`zero_load_misses` over ``requests``, each prompt length priced once."""
    last = timing.num_stages - 1
    stages = range(timing.num_stages)
    ttft_miss: dict[int, bool] = {}
    step_miss: dict[int, bool] = {}
    misses = 0
    for r in requests:
        p = r.input_tokens
        late = ttft_miss.get(p)
        if late is None:
            late = ttft_miss[p] = sum(timing.prefill_ms(s, p) + (timing.transfer_ms(s, p) if s < last else 0.0)
                                      for s in stages) > slo_ttft_ms
        if late:
            misses += 1
        elif r.output_tokens > 1:
            slow = step_miss.get(p)
            if slow is None:
                slow = step_miss[p] = sum(timing.decode_ms(s, 1, p) + (timing.transfer_ms(s, 1) if s < last else 0.0)
                                          for s in stages) > slo_tpot_ms
            misses += slow
    return misses


@dataclass(frozen=True)
class ZeroLoadScreen:
    """How much of its SLO miss allowance a gear spends with nothing else running, on the whole reference.

    Attributes:
        gear_id: the gear screened.
        miss_share: share of the reference's requests that miss the SLO even alone on the gear
            (:func:`zero_load_misses`, a lower bound: queueing only adds).
        allowance: the share that may miss, ``1 - attainment``.
        requests: requests read (the whole reference, evenly strided beyond :data:`SCREEN_MAX_REQUESTS`).
    """

    gear_id: str
    miss_share: float
    allowance: float
    requests: int

    @property
    def verdict(self) -> Literal["ok", "marginal", "infeasible"]:
        """``infeasible``: misses more than the allowance at any load; ``marginal``: more than
        :data:`MARGINAL_ALLOWANCE_SHARE` of it; else ``ok``."""
        if self.miss_share > self.allowance + 1e-12:
            return "infeasible"
        return "marginal" if self.miss_share > MARGINAL_ALLOWANCE_SHARE * self.allowance else "ok"

    def describe(self) -> str:
        """One sentence for people."""
        share = f"misses the SLO on {self.miss_share:.1%} of the trace's requests with nothing else running"
        if self.verdict == "infeasible":
            return f"{share}, over the {self.allowance:.1%} allowed: it cannot meet the SLO even with no load (infeasible)"
        return (f"{share}, over {MARGINAL_ALLOWANCE_SHARE:.0%} of the {self.allowance:.1%} allowed: queueing may add "
                "only the rest, so its envelope swings with the traffic mix (marginal)")


def screen_zero_load(gear: Gear, timing: StageTimingModel, reference: Workload, *, slo_ttft_ms: float,
                     slo_tpot_ms: float, attainment: float) -> ZeroLoadScreen:
    """:class:`ZeroLoadScreen` of ``gear`` on the whole of ``reference`` (no simulation; O(requests x stages)).

    The whole trace, not a probe's sample: the share of requests a gear cannot serve in time even idle
    is a property of the traffic mix, and a sample's share varies with where it was cut.
    """
    reqs = reference.requests
    if len(reqs) > SCREEN_MAX_REQUESTS:
        step = len(reqs) / SCREEN_MAX_REQUESTS
        reqs = tuple(reqs[int(i * step)] for i in range(SCREEN_MAX_REQUESTS))
    misses = _zero_load_misses(timing, reqs, slo_ttft_ms, slo_tpot_ms)
    return ZeroLoadScreen(gear.gear_id, misses / max(1, len(reqs)), 1.0 - attainment, len(reqs))


class _Prober:
    """The probes of one gear's envelope: short ones (:func:`probe_reference`'s length) for the bisection,
    long ones (:data:`CONFIRM_PROBE_S` on each of :data:`CONFIRM_PHASES`) for the confirmation; every probe
    run is kept in ``probes``, in order."""

    def __init__(self, gear: Gear, timing: StageTimingModel, reference: Workload, *, slo_ttft_ms: float,
                 slo_tpot_ms: float, attainment: float, num_requests: int, warmup_fraction: float, rel_tol: float,
                 sim_config: SimConfig | None, probes: Sequence[EnvelopeProbe] = ()) -> None:
        if not 0 < attainment <= 1:
            raise InputError("refine_envelopes", "attainment", f"got {attainment}; expected 0 < attainment <= 1")
        if not 0 < rel_tol < 1:
            raise InputError("refine_envelopes", "rel_tol", f"got {rel_tol}; expected 0 < rel_tol < 1")
        if not 0 <= warmup_fraction < 1:
            raise InputError("refine_envelopes", "warmup_fraction", f"got {warmup_fraction}; expected 0 <= f < 1")
        self.gear, self.timing, self.reference = gear, timing, reference
        self.slo_ttft_ms, self.attainment, self.num_requests = slo_ttft_ms, attainment, num_requests
        self.warmup_fraction, self.rel_tol = warmup_fraction, rel_tol
        # probes grade per-request outcomes: no metric samples (at 0.01 req/s they were most of the cost)
        self.config = dataclasses.replace(sim_config or SimConfig(), slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                                          metric_samples=False)
        self.ref, self.native_rps = reference_slice(reference, num_requests)
        self.floor_rps = self.native_rps * MIN_SPEEDUP  # the slowest the trace can be replayed
        self.probes: list[EnvelopeProbe] = list(probes)

    def _run(self, rate: float, **sample: float) -> EnvelopeProbe:
        probe_ref, probe_native = probe_reference(self.reference, self.num_requests, rate, self.slo_ttft_ms, **sample)
        p = probe_gear(self.gear, self.timing, probe_ref, probe_native, rate, config=self.config,
                       attainment=self.attainment, warmup_fraction=self.warmup_fraction)
        self.probes.append(p)
        return p

    def short(self, rate: float) -> EnvelopeProbe:
        """One probe of :func:`probe_length` requests at ``rate`` req/s."""
        return self._run(rate)

    def long(self, rate: float) -> EnvelopeProbe:
        """``rate`` on :data:`CONFIRM_PROBE_S` of arrivals, on each of :data:`CONFIRM_PHASES`' samples: the first
        failing probe, else the first sample's."""
        first: EnvelopeProbe | None = None
        for phase in CONFIRM_PHASES:
            p = self._run(rate, min_duration_s=CONFIRM_PROBE_S, phase=phase)
            if not p.passed:
                return p
            first = first or p
        assert first is not None
        return first

    def envelope(self, best: EnvelopeProbe | None, *, confirmed: bool) -> GearEnvelope:
        """The envelope ``best`` (the top passing probe; None: nothing passed) sets, with every probe run."""
        if best is None:
            est = self.probes[-1].estimate if self.probes else None
            return GearEnvelope(self.gear.gear_id, 0.0, self.gear.target_p99_ms, est, tuple(self.probes),
                                confirmed=confirmed)
        ok = math.isfinite(best.ttft_p99_ms) and best.ttft_p99_ms > 0
        target = best.ttft_p99_ms if ok else self.gear.target_p99_ms
        return GearEnvelope(self.gear.gear_id, best.rate_rps, max(1.0, target), best.estimate, tuple(self.probes),
                            confirmed=confirmed)


def measure_envelope(gear: Gear, timing: StageTimingModel, reference: Workload, *, slo_ttft_ms: float = 2000.0,
                     slo_tpot_ms: float = 200.0, attainment: float = 0.95, num_requests: int = 1000,
                     warmup_fraction: float = 0.25, rel_tol: float = 0.03, start_rps: float | None = None,
                     max_doublings: int = 12, max_halvings: int = 12, sim_config: SimConfig | None = None,
                     confirm: bool = True) -> GearEnvelope:
    """Bisect on the offered rate for the highest one ``gear`` serves within the SLO (module doc, steps 1-4).

    Each probe stops as soon as its verdict is certain (:func:`probe_gear`), so the failing probes,
    the costly ones, simulate only until enough requests have certainly missed the SLO. The sample
    is not cut for slow gears: 400-request windows of azure-conv gave envelopes 0.16-0.29 req/s for
    one Llama-2-70B gear where 1,000-request windows gave 0.23-0.25.

    Args:
        timing: stage times of ``gear`` (e.g. ``CostModel.timings(gear)``).
        reference: a real trace; its first ``num_requests`` requests are replayed at each rate.
        slo_ttft_ms / slo_tpot_ms: the SLO, ms. attainment: share of requests that must meet it.
        rel_tol: stop when the bracket ``[pass, fail]`` is this narrow relative to ``fail``.
        start_rps: first rate probed (default: the gear's analytic throughput, else the trace's rate).
        sim_config: other simulator settings; its SLO fields are replaced by the arguments.
        confirm: confirm the top on long probes (:func:`confirm_envelope`); False gives the short
            probes' top, an upper bound of the confirmed one, with ``confirmed`` False.

    Returns:
        The envelope with every probe, in the order run.

    Raises:
        InputError: bad attainment / tolerance / fractions, or a degenerate reference workload.
    """
    prober = _Prober(gear, timing, reference, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, attainment=attainment,
                     num_requests=num_requests, warmup_fraction=warmup_fraction, rel_tol=rel_tol,
                     sim_config=sim_config)
    graded_from, allowed = _measured_window(len(prober.ref), warmup_fraction, attainment)
    if zero_load_misses(gear, timing, prober.ref, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                        first_index=graded_from) > allowed:
        return GearEnvelope(gear.gear_id, 0.0, gear.target_p99_ms, None, (), confirmed=True)  # no rate meets the SLO
    if start_rps is None:
        promised = gear.rps_max if math.isfinite(gear.rps_max) and gear.rps_max > 0 else 0.0
        est = promised or (gear.estimate.throughput_rps if gear.estimate is not None else 0.0)
        start_rps = est if est > 0 and math.isfinite(est) else prober.native_rps
    if not (start_rps > 0 and math.isfinite(start_rps)):
        raise InputError("refine_envelopes", "start_rps", f"got {start_rps}; expected a rate > 0 req/s")
    start_rps = max(start_rps, prober.floor_rps)
    first = prober.short(start_rps)
    best: EnvelopeProbe | None = first if first.passed else None
    fail_rate: float | None = None if first.passed else start_rps
    rate = start_rps
    if first.passed:
        for _ in range(max_doublings):
            rate *= 2.0
            p = prober.short(rate)
            if not p.passed:
                fail_rate = rate
                break
            best = p
    else:
        for _ in range(max_halvings):
            rate /= 2.0
            if rate < prober.floor_rps:
                break
            p = prober.short(rate)
            if p.passed:
                best = p
                break
            fail_rate = rate
    if best is not None and fail_rate is not None:
        best = _bisect(prober.short, best, fail_rate, rel_tol)
    if best is None or not confirm:
        return prober.envelope(best, confirmed=best is None)
    return _confirm(prober, best, max_halvings)


def confirm_envelope(gear: Gear, timing: StageTimingModel, reference: Workload, envelope: GearEnvelope, *,
                     slo_ttft_ms: float = 2000.0, slo_tpot_ms: float = 200.0, attainment: float = 0.95,
                     num_requests: int = 1000, warmup_fraction: float = 0.25, rel_tol: float = 0.03,
                     start_rps: float | None = None, max_doublings: int = 12, max_halvings: int = 12,
                     sim_config: SimConfig | None = None) -> GearEnvelope:
    """The confirmation of module doc step 3 for an envelope :func:`measure_envelope` measured with
    ``confirm=False`` and the same settings: its top must hold on :data:`CONFIRM_PROBE_S` of arrivals on
    each of :data:`CONFIRM_PHASES`' samples, else the confirming probes step down and bisect back up.

    ``start_rps`` and ``max_doublings`` are accepted (the settings of :func:`measure_envelope`) and unused.
    An envelope already confirmed, or of 0, is returned as it is.

    Returns:
        The confirmed envelope (``rps_max`` <= ``envelope.rps_max``), its probes after ``envelope``'s.

    Raises:
        InputError: as :func:`measure_envelope`.
    """
    del start_rps, max_doublings
    if envelope.confirmed or envelope.rps_max <= 0:
        return envelope
    prober = _Prober(gear, timing, reference, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, attainment=attainment,
                     num_requests=num_requests, warmup_fraction=warmup_fraction, rel_tol=rel_tol,
                     sim_config=sim_config, probes=envelope.probes)
    top = next((p for p in reversed(envelope.probes) if p.passed and p.rate_rps == envelope.rps_max), None)
    if top is None:
        raise InputError(gear.gear_id, "envelope", f"no passing probe at its rps_max {envelope.rps_max:g} req/s")
    return _confirm(prober, top, max_halvings)


def _confirm(prober: _Prober, best: EnvelopeProbe, max_halvings: int) -> GearEnvelope:
    """Module doc step 3's confirmation of the short probes' top ``best``: the confirmed envelope."""
    confirmed = prober.long(best.rate_rps)
    if not confirmed.passed:  # the short probes' top does not hold for CONFIRM_PROBE_S: step down, then bisect
        top = hi = rate = best.rate_rps
        found: EnvelopeProbe | None = None
        for _ in range(max_halvings):  # steps of 10 % down to half the top, halvings below it
            rate *= CONFIRM_STEP_DOWN if top / rate < 2.0 else 0.5
            if rate < prober.floor_rps:
                break
            p = prober.long(rate)
            if p.passed:
                found = p
                break
            hi = rate
        if found is None:
            return prober.envelope(None, confirmed=True)
        confirmed = _bisect(prober.long, found, hi, prober.rel_tol)
    return prober.envelope(confirmed, confirmed=True)


def _bisect(run: Callable[[float], EnvelopeProbe], passed: EnvelopeProbe, fail_rps: float,
            rel_tol: float) -> EnvelopeProbe:
    """The highest passing probe ``run`` finds between ``passed`` (a passing probe) and ``fail_rps`` (a failing
    rate), bisecting (geometrically while the bracket spans more than 4x) until it is ``rel_tol`` narrow."""
    best, lo, hi = passed, passed.rate_rps, fail_rps
    while (hi - lo) / hi > rel_tol:
        mid = math.sqrt(lo * hi) if hi / lo > 4 else (lo + hi) / 2.0
        p = run(mid)
        if p.passed:
            best, lo = p, mid
        else:
            hi = mid
    return best


def apply_envelopes(gears: Sequence[Gear], envelopes: Sequence[GearEnvelope], *,
                    overlap_fraction: float = 0.7) -> list[Gear]:
    """Copies of ``gears`` (same order) carrying the measured envelopes; ``rps_min`` per module doc, step 5.

    Raises:
        InputError: ``overlap_fraction`` outside [0, 1], or an envelope for a gear not given.
    """
    if not 0 <= overlap_fraction <= 1:
        raise InputError("refine_envelopes", "overlap_fraction", f"got {overlap_fraction}; expected 0..1")
    by_id = {e.gear_id: e for e in envelopes}
    missing = [g.gear_id for g in gears if g.gear_id not in by_id]
    if missing:
        raise InputError("refine_envelopes", "envelopes", f"no envelope for gear(s) {missing}")
    order = sorted(range(len(gears)), key=lambda i: (by_id[gears[i].gear_id].rps_max, gears[i].gear_id))
    rps_min: dict[int, float] = {}
    prev = None
    for i in order:
        rps_min[i] = 0.0 if prev is None else overlap_fraction * prev
        prev = by_id[gears[i].gear_id].rps_max
    out = []
    for i, g in enumerate(gears):
        env = by_id[g.gear_id]
        out.append(g.model_copy(update={"rps_min": min(rps_min[i], env.rps_max), "rps_max": env.rps_max,
                                        "target_p99_ms": env.target_p99_ms,
                                        "estimate": env.estimate if env.estimate is not None else g.estimate}))
    return out


def measure_envelopes(gears: Sequence[Gear], cost_model: TimingProvider | TimingSource, reference_workload: Workload,
                      **kwargs: Unpack[ProbeSettings]) -> list[GearEnvelope]:
    """:func:`measure_envelope` for each gear, timings from ``cost_model`` (see :func:`refine_envelopes`)."""
    timing_for = _timing_source(cost_model)
    return [measure_envelope(g, timing_for(g), reference_workload, **kwargs) for g in gears]


def refine_envelopes(gears: Sequence[Gear], cost_model: TimingProvider | TimingSource, reference_workload: Workload, *,
                     slo_ttft_ms: float = 2000.0, slo_tpot_ms: float = 200.0, attainment: float = 0.95,
                     num_requests: int = 1000, warmup_fraction: float = 0.25, rel_tol: float = 0.03,
                     overlap_fraction: float = 0.7, sim_config: SimConfig | None = None,
                     report: list[GearEnvelope] | None = None) -> list[Gear]:
    """Replace each gear's envelope and estimate with ones measured in the simulator (module doc).

    Args:
        gears: gears to score (e.g. :func:`~flexpipe_dag.planner.gears.plan_gears`'s), any order.
        cost_model: ``.timings(gear) -> StageTimingModel`` (the planner's
            :class:`~flexpipe_dag.planner.cost_model.CostModel`), or a callable ``gear -> timing``.
        reference_workload: a real trace (e.g. ``load_trace("azure-conv")``); its first
            ``num_requests`` requests are replayed at each probed rate.
        slo_ttft_ms / slo_tpot_ms: the SLO a request must meet, ms.
        attainment: share of (post-warm-up) requests that must meet it for a rate to count as served.
        num_requests / warmup_fraction / rel_tol: probe size, warm-up skipped, bisection tolerance.
        overlap_fraction: ``rps_min`` of a gear = this x the next-smaller gear's ``rps_max``.
        sim_config: other simulator settings (KV overrides, prefill budget, ...).
        report: if given, the :class:`GearEnvelope` of each gear (with its probes) is appended.

    Returns:
        New gears, same order, with ``rps_min``, ``rps_max``, ``target_p99_ms`` (TTFT P99 at
        ``rps_max``, ms) and ``estimate`` from the simulation; ids and pipelines unchanged.

    Raises:
        InputError: bad arguments (named), or a timing model that does not match a gear.
    """
    envs = measure_envelopes(gears, cost_model, reference_workload, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                             attainment=attainment, num_requests=num_requests, warmup_fraction=warmup_fraction,
                             rel_tol=rel_tol, sim_config=sim_config)
    if report is not None:
        report.extend(envs)
    return apply_envelopes(gears, envs, overlap_fraction=overlap_fraction)


def gear_id_suffix(gear_id: str) -> str:
    """What a gear id keeps when the gear is relabelled: everything after the kind prefix."""
    return gear_id.split("-", 1)[1] if "-" in gear_id else gear_id


def _relabel(gear: Gear, kind: str) -> Gear:
    """``gear`` as ``kind``: the id's kind prefix is swapped, the hash suffix kept."""
    return gear.model_copy(update={"kind": kind, "gear_id": f"{kind}-{gear_id_suffix(gear.gear_id)}"})


@dataclass(frozen=True)
class OperatingSelection:
    """What :func:`select_operating_gears` chose and why.

    Attributes:
        gears: the chosen gears, ordered latency, balanced, throughput (a kind with no distinct
            candidate is left out), relabelled and carrying their measured envelopes.
        envelopes: the measured :class:`GearEnvelope` of every candidate, with its probes (``confirmed``
            only for the candidates that were chosen in some round).
        notes: a sentence for each kind left out.
    """

    gears: list[Gear]
    envelopes: list[GearEnvelope]
    notes: list[str]


def _choose(pool: Sequence[Gear], envs: dict[str, GearEnvelope], low_load: Callable[[Gear, float], tuple[float, float]],
            settings: SelectionSettings, *, by_devices: bool) -> tuple[dict[str, Gear], float]:
    """The rules of :func:`select_operating_gears` on the envelopes ``envs``: ``({kind: gear}, best rps_max)``.

    ``low_load(gear, q_low)`` gives the gear's (TPOT P50, TTFT P50), ms, at ``q_low`` req/s."""
    best_max = max(e.rps_max for e in envs.values())
    q_low = settings.low_load_share * best_max
    low = {g.gear_id: low_load(g, q_low) for g in pool if q_low > 0 and envs[g.gear_id].rps_max >= q_low}
    inf = (math.inf, math.inf)

    def devices(g: Gear) -> int:
        return len(g.device_ids)

    def power(g: Gear) -> float:
        return envs[g.gear_id].rps_max / max(low[g.gear_id][0], 1e-9)

    if by_devices:
        tied = [g for g in pool if envs[g.gear_id].rps_max >= (1.0 - settings.rel_tol) * best_max]
        thr = min(tied, key=lambda g: (devices(g), -envs[g.gear_id].rps_max, low.get(g.gear_id, inf), g.gear_id))
    else:
        thr = max(pool, key=lambda g: (envs[g.gear_id].rps_max, [-x for x in low.get(g.gear_id, inf)], g.gear_id))
    chosen: dict[str, Gear] = {"throughput": thr}
    others = [g for g in pool if g.gear_id != thr.gear_id and g.gear_id in low]
    if others:
        if by_devices:
            lat = min(others, key=lambda g: (devices(g), round(low[g.gear_id][0], 6), round(low[g.gear_id][1], 6), g.gear_id))
            better = (devices(lat), low[lat.gear_id]) < (devices(thr), low.get(thr.gear_id, inf))
        else:
            lat = min(others, key=lambda g: (round(low[g.gear_id][0], 6), round(low[g.gear_id][1], 6), g.gear_id))
            better = low[lat.gear_id] < low.get(thr.gear_id, inf)
        if better:
            chosen["latency"] = lat
    lo = envs[chosen["latency"].gear_id].rps_max if "latency" in chosen else 0.0
    hi = envs[thr.gear_id].rps_max
    # a gear the throughput gear beats on every count (no fewer devices, no lower TPOT at the low load,
    # a smaller envelope) is no operating point between the two
    mid = [g for g in others if g.gear_id not in {c.gear_id for c in chosen.values()}
           and lo < envs[g.gear_id].rps_max < hi
           and not (devices(g) >= devices(thr) and low[g.gear_id] >= low.get(thr.gear_id, inf))]
    if mid:
        chosen["balanced"] = max(mid, key=lambda g: (envs[g.gear_id].rps_max / devices(g), power(g), g.gear_id))
    return chosen, best_max


def select_operating_gears(candidates: Sequence[Gear], cost_model: TimingProvider | TimingSource,
                           reference_workload: Workload, settings: SelectionSettings = SelectionSettings(),
                           objective: SelectionObjective = "speed") -> OperatingSelection:
    """Pick the latency / balanced / throughput gears from ``candidates`` by simulation and set their envelopes.

    First each candidate is screened at zero load on the whole reference (:func:`screen_zero_load`): one
    that misses the SLO idle on more than :data:`MARGINAL_ALLOWANCE_SHARE` of the allowed share of
    requests is left out unmeasured (``GearEnvelope.screened`` says why; a note counts them), unless
    every candidate is, when all stay with envelope 0. Every other candidate's envelope is measured on
    the short probes (:func:`measure_envelope` with ``confirm=False``); then the slots below are filled,
    the chosen gears' envelopes confirmed on long probes (:func:`confirm_envelope`), and the slots filled
    again until every chosen gear's envelope is confirmed (a confirmation only lowers an envelope, so no
    unconfirmed candidate's upper bound beats a chosen gear's confirmed one where the rules compare
    envelopes). With ``objective="speed"`` (default),

    * ``throughput``: the highest ``rps_max`` (ties: lower TPOT P50 at the low load);
    * ``latency``: among the others serving the low load ``q_low = low_load_share x`` that
      ``rps_max``, the lowest TPOT P50 there, then the lowest TTFT P50;
    * ``balanced``: among the rest with ``rps_max`` strictly between the two, the most envelope per
      device, ``rps_max / devices`` (ties: the highest power ``rps_max / TPOT P50 at q_low``,
      Kleinrock 1979); never one the throughput gear beats on every count (as many devices or
      more, and a TPOT at ``q_low`` no lower).

    With ``objective="devices"`` the same slots are filled by SLO goodput per device, the figure
    DistServe (OSDI'24) scores serving by (a gear's devices are its ``device_ids``, replicas included):

    * ``throughput``: the highest ``rps_max``, where every candidate within ``rel_tol`` of it ties
      (the bisection measures envelopes no finer), and among the tied the fewest devices, then the
      highest ``rps_max``, then the lower TPOT P50 at ``q_low``;
    * ``latency``: among the others serving ``q_low``, the fewest devices (every one of them
      delivers the same goodput there, so this is the most goodput per device), then the lowest
      TPOT P50 at ``q_low``, then TTFT P50: the cheapest gear that holds the low load;
    * ``balanced``: among the rest with ``rps_max`` strictly between the two, the highest
      ``rps_max / devices`` (goodput per device at its envelope), then the highest power.

    A kind with no distinct candidate is left out and a sentence saying so is in the ``notes``.

    Args:
        candidates: distinct configurations, e.g. :func:`flexpipe_dag.planner.gears.candidate_gears`.
        cost_model / reference_workload: as :func:`refine_envelopes`.
        settings: SLO, probe size, tolerances (:class:`SelectionSettings`).
        objective: ``"speed"`` or ``"devices"`` (above).

    Returns:
        An :class:`OperatingSelection`: the chosen gears, ordered latency, balanced, throughput,
        relabelled (kind and id prefix) and carrying their measured envelopes and estimates; every
        candidate's envelope; the notes.

    Raises:
        InputError: no candidates, an unknown ``objective``, or as :func:`refine_envelopes`.
    """
    if not candidates:
        raise InputError("select_operating_gears", "candidates", "expected at least one candidate gear")
    if objective not in SELECTION_OBJECTIVES:
        raise InputError("select_operating_gears", "objective",
                         f"got {objective!r}; expected one of {', '.join(SELECTION_OBJECTIVES)}")
    timing_for = _timing_source(cost_model)
    kw = settings.probe_settings()
    attainment = settings.attainment
    timings = {g.gear_id: timing_for(g) for g in candidates}
    screens = {g.gear_id: screen_zero_load(g, timings[g.gear_id], reference_workload, slo_ttft_ms=settings.slo_ttft_ms,
                                           slo_tpot_ms=settings.slo_tpot_ms, attainment=attainment) for g in candidates}
    envs = {g.gear_id: (measure_envelope(g, timings[g.gear_id], reference_workload, confirm=False, **kw)
                        if screens[g.gear_id].verdict == "ok" else
                        GearEnvelope(g.gear_id, 0.0, g.target_p99_ms, None, (), screened=screens[g.gear_id].describe()))
            for g in candidates}
    screened_out = [g for g in candidates if envs[g.gear_id].screened]
    pool = [g for g in candidates if not envs[g.gear_id].screened] or list(candidates)
    base = settings.sim_config or SimConfig()
    config = dataclasses.replace(base, slo_ttft_ms=settings.slo_ttft_ms, slo_tpot_ms=settings.slo_tpot_ms,
                                 metric_samples=False)
    ref, native = reference_slice(reference_workload, min(settings.num_requests, settings.low_load_requests))
    low_cache: dict[tuple[str, float], tuple[float, float]] = {}

    def low_load(g: Gear, q_low: float) -> tuple[float, float]:
        """TPOT P50 and TTFT P50 (ms) of ``g`` at ``q_low`` req/s."""
        key = (g.gear_id, q_low)
        if key not in low_cache:
            est = probe_gear(g, timings[g.gear_id], ref, native, q_low, config=config, attainment=attainment).estimate
            low_cache[key] = (est.tpot_p50_ms, est.ttft_p50_ms)
        return low_cache[key]

    # Only the chosen gears' envelopes are confirmed (the long probes cost most of planning). A short-probe
    # top bounds the confirmed one from above, so choosing again after each confirmation until every chosen
    # gear is confirmed leaves no unconfirmed candidate able to beat a chosen one on its envelope.
    while True:
        chosen, best_max = _choose(pool, envs, low_load, settings, by_devices=objective == "devices")
        todo = [g for g in chosen.values() if not envs[g.gear_id].confirmed]
        if not todo:
            break
        for g in todo:
            envs[g.gear_id] = confirm_envelope(g, timings[g.gear_id], reference_workload, envs[g.gear_id], **kw)
    by_devices = objective == "devices"
    notes: list[str] = []
    if screened_out:
        worst = max(screened_out, key=lambda g: screens[g.gear_id].miss_share)
        notes.append(f"{len(screened_out)} of {len(candidates)} candidates left out unmeasured (marginal or "
                     f"infeasible), each missing the SLO on more than {MARGINAL_ALLOWANCE_SHARE:.0%} of the "
                     f"{1 - attainment:.1%} allowed with nothing else running; e.g. {worst.gear_id} "
                     f"{screens[worst.gear_id].describe()}")
    if best_max <= 0:
        notes.append(f"no candidate meets the SLO (TTFT <= {settings.slo_ttft_ms:g} ms, TPOT <= {settings.slo_tpot_ms:g} "
                     f"ms for {settings.attainment:.0%} of requests) at any load: relax the SLO, shorten the prompts "
                     "or plan on faster devices")
    for kind in ("latency", "balanced"):
        if kind not in chosen:
            notes.append(f"no {kind} gear distinct from the others: among {len(candidates)} candidates none "
                         + (("uses fewer devices (or as few with a lower TPOT) at the low load than the throughput gear"
                             if by_devices else "has a lower TPOT at the low load than the throughput gear")
                            if kind == "latency" else
                            "has an envelope strictly between the latency and throughput gears'"))
    order = [k for k in ("latency", "balanced", "throughput") if k in chosen]
    picked = [chosen[k] for k in order]
    picked_envs = [envs[g.gear_id] for g in picked]
    relabelled = [_relabel(g, k) for g, k in zip(picked, order)]
    renamed = [dataclasses.replace(e, gear_id=g.gear_id) for e, g in zip(picked_envs, relabelled)]
    return OperatingSelection(gears=apply_envelopes(relabelled, renamed, overlap_fraction=settings.overlap_fraction),
                              envelopes=list(envs.values()), notes=notes)


def holdout_reference(reference: Workload, num_requests: int) -> Workload:
    """``num_requests`` requests of ``reference`` that envelopes are never measured on, drawn from across it
    as the planner's sample is: runs of :data:`SAMPLE_RUN_REQUESTS` at phase 0.5, between the
    planner's runs (phase 0). A trace shorter than ``2 x num_requests`` gives all the requests outside
    the planner's sample, in arrival order, rebased to start at 0 s.

    Raises:
        InputError: fewer than 2 requests follow.
    """
    if len(reference) - num_requests < 2:
        raise InputError(reference.source or reference.name, "num_requests",
                         f"the trace has {len(reference)} requests; a held-out check needs at least 2 beside the "
                         f"{num_requests} envelopes are measured on")
    if len(reference) >= 2 * num_requests:
        return sample_chunks(reference, num_requests, chunk_requests=SAMPLE_RUN_REQUESTS, phase=0.5)
    seen = {r.request_id for r in reference_slice(reference, num_requests)[0].requests}
    rest = tuple(r for r in reference.requests if r.request_id not in seen)
    t0 = rest[0].arrival_s
    return Workload(name=f"{reference.name}[held out]", source=reference.source, meta=dict(reference.meta),
                    requests=tuple(dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in rest))


@dataclass(frozen=True)
class PromiseCheck:
    """A gear replayed at a share of its own ``rps_max``: does the promise hold?

    Attributes:
        gear_id: the gear checked. workload: the trace stretch replayed.
        rate_rps: offered mean rate, req/s (``load_share x rps_max``).
        slo_attainment: share of requests after the warm-up meeting the SLO there.
        lost: requests rejected or unfinished.
        passed: ``slo_attainment >= min_attainment`` and nothing lost.
        estimate: what the gear did there (throughput, TTFT / TPOT percentiles).
        result: the simulation itself (per-request rows, samples).
    """

    gear_id: str
    workload: str
    rate_rps: float
    slo_attainment: float
    lost: int
    passed: bool
    estimate: GearEstimate = field(repr=False, compare=False)
    result: SimResult = field(repr=False, compare=False)


def check_promise(gear: Gear, timing: StageTimingModel, workload: Workload, *, slo_ttft_ms: float, slo_tpot_ms: float,
                  load_share: float = 0.8, min_attainment: float = 0.9,
                  sim_config: SimConfig | None = None) -> PromiseCheck:
    """Replay ``workload`` (e.g. :func:`holdout_reference`) through ``gear`` at ``load_share x rps_max``.

    The issue-13 acceptance test of an envelope: at 80 % of its own ``rps_max`` a gear keeps SLO
    attainment >= 0.9 on requests it was not measured on.

    Raises:
        InputError: ``load_share`` not in (0, 1], ``min_attainment`` not in (0, 1], a gear without a
            finite ``rps_max`` > 0, or a degenerate workload.
    """
    if not 0 < load_share <= 1:
        raise InputError(gear.gear_id, "load_share", f"got {load_share}; expected 0 < share <= 1")
    if not 0 < min_attainment <= 1:
        raise InputError(gear.gear_id, "min_attainment", f"got {min_attainment}; expected 0 < attainment <= 1")
    if not (math.isfinite(gear.rps_max) and gear.rps_max > 0):
        raise InputError(gear.gear_id, "rps_max", f"got {gear.rps_max}; a promise check needs a finite envelope > 0")
    config = dataclasses.replace(sim_config or SimConfig(), slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
    rate = load_share * gear.rps_max
    ref, native = probe_reference(workload, len(workload), rate, slo_ttft_ms)  # repeated if too short for the rate
    p, result = _probe(gear, timing, ref, native, rate, config=config, attainment=min_attainment,
                       warmup_fraction=0.25, early_stop=False)
    return PromiseCheck(gear_id=gear.gear_id, workload=ref.name, rate_rps=rate, slo_attainment=p.slo_attainment,
                        lost=p.lost, passed=p.passed, estimate=p.estimate, result=result)
