"""How one instance's SLO attainment falls with its load: the curve the fleet day model reads.

For each instance template (:class:`~flexpipe_dag.planner.fleet.InstanceTemplate`) the discrete-event
simulator replays the reference trace (the envelope's method and sample: ``settings.num_requests``
requests drawn across the trace, and at least :data:`~flexpipe_dag.planner.envelope.CONFIRM_PROBE_S` of
arrivals, as the probes that confirmed the envelope; time-compressed to the rate, lengths and burstiness
kept) at a grid of loads, as fractions of the instance's envelope ``rps_max``, and grades every request after the warm-up against the SLO
(no early stop: the attainment is the full run's). Probed otherwise than the envelope, the curve
disagrees with it: with 600-request, 40-s probes the fleet_1k curves read 0.99+ past the confirmed
envelopes, and with 600 requests (not the envelope's 1,000) fleet_small's A10 curve read 0.939 at its
envelope, where the request-by-request fleet simulator measured 0.997 over a tide day. Between grid points the curve is linear; above the
last point the served share falls as ``1 / load`` (an instance at twice its saturation serves half of
what arrives in time at best).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.planner.envelope import CONFIRM_PROBE_S, probe_gear, probe_reference
from flexpipe_dag.planner.fleet import FleetPlan, FleetSettings, InstanceTemplate
from flexpipe_dag.sim.config import SimConfig
from flexpipe_dag.workload.request import Workload

#: Loads probed, as fractions of the instance's envelope: dense near it, where the curve bends.
DEFAULT_LOAD_FRACTIONS: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6, 2.0)


@dataclass(frozen=True)
class AttainmentCurve:
    """SLO attainment (0..1) of one instance against its load, as a fraction of its ``rps_max``.

    Attributes:
        load_fractions: shape ``(k,)``, increasing, > 0.
        attainment: shape ``(k,)``, the share of requests meeting the SLO at each load.
        rps_max: the instance's envelope, req/s.
    """

    load_fractions: np.ndarray
    attainment: np.ndarray
    rps_max: float

    def at(self, load_fraction: np.ndarray | float) -> np.ndarray:
        """Attainment at ``load_fraction`` (array or scalar): the first point's below it, linear between
        points, ``last x last_fraction / load`` above the last."""
        x = np.asarray(load_fraction, dtype=float)
        inside = np.interp(x, self.load_fractions, self.attainment)
        top = float(self.load_fractions[-1])
        beyond = self.attainment[-1] * top / np.maximum(x, top)
        out: np.ndarray = np.where(x > top, beyond, inside)
        return out

    def saturation_fraction(self, attainment: float) -> float:
        """The load fraction at which the curve first falls below ``attainment`` (linear between points): the
        most the instance serves in time; the last point's when it never falls below, the first's when
        it starts below."""
        a, f = self.attainment, self.load_fractions
        below = np.flatnonzero(a < attainment)
        if below.size == 0:
            return float(f[-1])
        j = int(below[0])
        if j == 0:
            return float(f[0])
        return float(f[j - 1] + (f[j] - f[j - 1]) * (a[j - 1] - attainment) / (a[j - 1] - a[j]))


def measure_attainment_curve(template: InstanceTemplate, reference: Workload, settings: FleetSettings, *,
                             load_fractions: Sequence[float] = DEFAULT_LOAD_FRACTIONS,
                             num_requests: int | None = None, warmup_fraction: float = 0.25) -> AttainmentCurve:
    """Simulate ``template``'s gear at each load fraction of its envelope (module docstring).

    Raises:
        InputError: no load fractions, one not > 0, not increasing; a template without a finite envelope.
    """
    fractions = np.asarray(list(load_fractions), dtype=float)
    if fractions.size == 0 or np.any(fractions <= 0) or np.any(np.diff(fractions) <= 0):
        raise InputError("attainment curve", "load_fractions", f"got {list(load_fractions)}; expected increasing values > 0")
    if not (math.isfinite(template.rps_max) and template.rps_max > 0):
        raise InputError("attainment curve", template.gear.gear_id, f"rps_max {template.rps_max}; expected a finite envelope > 0")
    config = SimConfig(slo_ttft_ms=settings.slo_ttft_ms, slo_tpot_ms=settings.slo_tpot_ms)
    num_requests = settings.num_requests if num_requests is None else num_requests
    attained = []
    for f in fractions:
        rate = float(f) * template.rps_max
        # as long as the probes that confirmed the envelope (CONFIRM_PROBE_S of arrivals): shorter ones end before an
        # instance near its top fills its seats, and read 0.99+ past the envelope the long probes set
        ref, native = probe_reference(reference, num_requests, rate, settings.slo_ttft_ms, min_duration_s=CONFIRM_PROBE_S)
        attained.append(probe_gear(template.gear, template.timing, ref, native, rate, config=config,
                                   attainment=settings.attainment, warmup_fraction=warmup_fraction,
                                   early_stop=False).slo_attainment)
    return AttainmentCurve(load_fractions=fractions, attainment=np.asarray(attained, dtype=float),
                           rps_max=template.rps_max)


def measure_attainment_curves(plan: FleetPlan, reference: Workload, settings: FleetSettings, *,
                              num_requests: int | None = None) -> dict[int, AttainmentCurve]:
    """:func:`measure_attainment_curve` for every template of ``plan``, by template index."""
    return {i: measure_attainment_curve(t, reference, settings, num_requests=num_requests)
            for i, t in enumerate(plan.templates)}
