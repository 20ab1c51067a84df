"""Fleet gears: many pipeline instances of different shapes over one fleet, sized for the load.

On a fleet of hundreds of hosts one pipeline is the wrong unit: a gear that spans the fleet runs at
its slowest stage, and the load a day brings is served by *many* pipelines side by side. A **fleet
gear** is a set of pipeline instances, each an ordinary :class:`~flexpipe_dag.core.gear.Gear` over
its own devices; requests are routed across instances (least outstanding work per unit of capacity,
KV-aware admission: :mod:`flexpipe_dag.sim.fleet` in the simulator, :mod:`flexpipe_dag.shift.instances`
in the runtime), and its envelope is the **sum** of its instances' measured envelopes.

How the instances are planned (:func:`plan_fleet`):

1. Hosts are grouped by **shape**: the devices they hold (profile, dtype support, in order) and how
   those devices talk (intra-host figures). Identical hosts in identical positions get identical
   plans, so planning costs one plan per shape, not per host.
2. The **unit** of a shape is the fewest hosts of that shape, in one rack, on which the model fits
   (one host for a model its devices hold; 2, 4, ... for one they do not, up to ``max_unit_hosts``).
   The planner's operating gears are planned on one unit and their envelopes measured in the
   simulator on the reference trace (:func:`~flexpipe_dag.planner.envelope.measure_envelope`, short probes;
   only the best per device is confirmed on long ones, :func:`~flexpipe_dag.planner.envelope.confirm_envelope`); the
   gear with the most requests/s per device is the shape's **template**.
3. Every unit of the fleet becomes one instance: the template with its devices mapped by position
   (host k of the unit, device j of the host), when the unit's device pairs have the template unit's
   link figures; a unit whose links differ (a measured pair, a profile without a topology) is planned
   on its own. Hosts left over (a rack with fewer hosts than a unit,
   a shape on which nothing fits the SLO) are listed in :attr:`FleetPlan.notes` and serve nothing.
4. The instances are ordered by envelope per device, best first (ties: larger envelope, then id).
   The fleet gear for a load ``L`` is the shortest prefix of that order whose summed envelope, less the
   headroom, holds ``L``. Fleet gears are *nested*: a larger one is a smaller one plus instances, so
   shifting between them only adds instances (scale out) or drains and removes them (scale in); the
   instances that stay are never re-partitioned, and their requests never move.

Re-partitioning one instance (a different gear on the same devices) is the single-pipeline gear
shift (:mod:`flexpipe_dag.shift.executor`), unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flexpipe_dag.core.cluster import ClusterProfile, Device
from flexpipe_dag.core.errors import InfeasibleError, InputError
from flexpipe_dag.core.gear import Gear, StagePlan
from flexpipe_dag.core.settings import check_number
from flexpipe_dag.core.timing import StageTimingModel
from flexpipe_dag.planner.envelope import (
    GearEnvelope,
    ProbeSettings,
    apply_envelopes,
    confirm_envelope,
    measure_envelope,
)
from flexpipe_dag.planner.gears import make_search, plan_gear_set
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.planner.workload import PlanWorkload
from flexpipe_dag.workload.request import Workload

#: Most hosts one pipeline instance may span (a model that needs more is left unplanned on that shape).
MAX_UNIT_HOSTS = 16
#: Share of a fleet gear's summed envelope held back by default. An envelope is the edge of an instance's
#: attainment cliff (the highest rate at which 95 % of requests meet the SLO, probed long enough for the
#: rate): measured curves stay at >= 0.998 to about 85 % of it, are near 0.99 at 100 % and collapse just
#: above (an A100 host of fleet_1k: 0.988 at 1.0x, 0.16 at 1.15x). Holding 10 % back keeps instances on the
#: flat part, where a fleet attains what a static gear sized for the peak does; 5 % gave up 0.2-0.5
#: points of SLO attainment over a tide day (``bench/fleet_scale.py``).
DEFAULT_HEADROOM_FRACTION = 0.10

HostShape = tuple[object, ...]


@dataclass(frozen=True)
class InstanceTemplate:
    """The pipeline every unit of one host shape runs.

    Attributes:
        shape: the host shape key (devices' profiles and intra-host figures).
        unit_host_ids: the hosts of the unit the template was planned on (``unit_hosts`` of them).
        gear: the template gear over those hosts' devices, its envelope (``rps_max``, req/s) measured
            in the simulator.
        timing: the gear's stage-time model (the simulator's input).
        candidates: ``(gear_id, devices, rps_max, confirmed)`` of every operating gear measured on the unit (an
            unconfirmed ``rps_max`` is its short probes' top, an upper bound: only the template is confirmed).
    """

    shape: HostShape
    unit_host_ids: tuple[str, ...]
    gear: Gear
    timing: StageTimingModel
    candidates: tuple[tuple[str, int, float, bool], ...]

    @property
    def unit_hosts(self) -> int:
        return len(self.unit_host_ids)

    @property
    def num_devices(self) -> int:
        return len(self.gear.device_ids)

    @property
    def rps_max(self) -> float:
        return self.gear.rps_max

    @property
    def rps_per_device(self) -> float:
        return self.gear.rps_max / max(1, self.num_devices)


@dataclass(frozen=True)
class FleetInstance:
    """One pipeline instance of the fleet: a gear over its own hosts' devices.

    Attributes:
        instance_id: ``<first host>-<template gear kind>``, unique in the plan.
        host_ids: the hosts the instance runs on.
        gear: the instance's gear (the template's, devices mapped to these hosts), ``rps_max`` in req/s.
        template: index into :attr:`FleetPlan.templates`.
    """

    instance_id: str
    host_ids: tuple[str, ...]
    gear: Gear
    template: int

    @property
    def rps_max(self) -> float:
        return self.gear.rps_max

    @property
    def num_devices(self) -> int:
        return len(self.gear.device_ids)


@dataclass(frozen=True)
class FleetGear:
    """A set of pipeline instances served together; its envelope is the sum of theirs.

    Attributes:
        instances: the instances, in the plan's order (a prefix of :attr:`FleetPlan.instances`).
    """

    instances: tuple[FleetInstance, ...]

    @property
    def fleet_gear_id(self) -> str:
        """``fleet-<n>`` for the first ``n`` instances of the plan (fleet gears are nested prefixes)."""
        return f"fleet-{len(self.instances)}"

    @property
    def rps_max(self) -> float:
        """Summed envelope, req/s."""
        return float(sum(i.rps_max for i in self.instances))

    @property
    def num_devices(self) -> int:
        return sum(i.num_devices for i in self.instances)

    @property
    def device_ids(self) -> list[str]:
        return [d for i in self.instances for d in i.gear.device_ids]

    def holds(self, rps: float, headroom_fraction: float = DEFAULT_HEADROOM_FRACTION) -> bool:
        """Whether the summed envelope x (1 - headroom) holds ``rps`` req/s (the rule :meth:`FleetPlan.instances_for` sizes by)."""
        return self.rps_max >= needed_rps(rps, headroom_fraction)


def needed_rps(rps: float, headroom_fraction: float) -> float:
    """The summed envelope, req/s, that holds ``rps`` with ``headroom_fraction`` of it kept free.

    Raises:
        InputError: ``rps`` not finite, or the headroom outside [0, 1).
    """
    check_number(headroom_fraction, "fleet gear", "headroom_fraction", ge=0, lt=1)
    check_number(rps, "fleet gear", "rps", unit="req/s")
    return max(0.0, rps) / (1.0 - headroom_fraction)


@dataclass(frozen=True)
class FleetPlan:
    """Every instance the fleet can run, best envelope per device first, and how they were planned.

    Attributes:
        cluster_id: the fleet.
        templates: one per host shape that serves (see the module docstring).
        instances: every unit's instance, ordered by ``rps_max`` per device (best first).
        notes: hosts that serve nothing and why.
    """

    cluster_id: str
    templates: tuple[InstanceTemplate, ...]
    instances: tuple[FleetInstance, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def rps_max(self) -> float:
        """The whole fleet's summed envelope, req/s."""
        return float(sum(i.rps_max for i in self.instances))

    def prefix(self, num_instances: int) -> FleetGear:
        """The fleet gear of the first ``num_instances`` instances (0..len)."""
        check_number(num_instances, "fleet gear", "num_instances", integer=True, ge=0, le=len(self.instances))
        return FleetGear(self.instances[:num_instances])

    def instances_for(self, rps: float, headroom_fraction: float = DEFAULT_HEADROOM_FRACTION) -> int:
        """The fewest instances (a prefix) whose summed envelope x (1 - headroom) holds ``rps`` req/s; all
        of them when even the whole fleet does not (the caller sees ``rps`` above :attr:`rps_max`)."""
        need = needed_rps(rps, headroom_fraction)
        if need <= 0:
            return 0
        total = 0.0
        for n, inst in enumerate(self.instances, start=1):
            total += inst.rps_max
            if total >= need:
                return n
        return len(self.instances)

    def gear_for(self, rps: float, headroom_fraction: float = DEFAULT_HEADROOM_FRACTION) -> FleetGear:
        """:meth:`prefix` of :meth:`instances_for` (at least one instance)."""
        return self.prefix(max(1, self.instances_for(rps, headroom_fraction)))


def no_envelope_problem(rps_max: float | None) -> str:
    """What is wrong with scaling a gear that has no measured envelope, and what to do instead: the one wording of
    :func:`replicated_plan` and of ``flexpipe serve --max-instances``, which refuses a ``--stages`` gear before
    its checkpoint is read.

    Args:
        rps_max: the gear's ``rps_max`` (0 or unbounded), or None for a gear that has none (a ``--stages`` one).
    """
    held = "a --stages gear has no rps_max" if rps_max is None else f"rps_max {rps_max:g} req/s"
    return (f"the gear has no measured envelope ({held}): give --gear with a gear planned by `flexpipe plan` "
            "(or one whose rps_max is set), or --plan")


def replicated_plan(gear: Gear, num_instances: int, host_id: str = "localhost") -> FleetPlan:
    """A fleet plan of ``num_instances`` identical copies of ``gear`` on one host: what a server that runs
    several instances of its one gear scales over (``flexpipe serve --max-instances``).

    Every copy keeps the gear (its stages, devices and envelope, ``rps_max`` req/s); instance ``k`` is
    ``<gear_id>-<k>``. The plan has no templates (nothing was planned per host shape here), so it serves
    the scaler's sizing (:meth:`FleetPlan.instances_for`), not :func:`describe_plan`.

    Args:
        gear: the served gear; its ``rps_max`` must be a measured envelope (finite, > 0).
        num_instances: copies, the most the scaler may run (>= 1).
        host_id: the host they all run on.

    Raises:
        InputError: ``num_instances`` below 1, or a gear without a measured envelope (``rps_max`` 0 or
            unbounded: plan the gear first).
    """
    check_number(num_instances, "fleet plan", "num_instances", integer=True, ge=1, le=10**6)
    if not (math.isfinite(gear.rps_max) and gear.rps_max > 0):
        raise InputError(gear.gear_id, "rps_max", no_envelope_problem(gear.rps_max))
    instances = tuple(FleetInstance(instance_id=f"{gear.gear_id}-{k}", host_ids=(host_id,), gear=gear, template=0)
                      for k in range(num_instances))
    return FleetPlan(cluster_id=host_id, templates=(), instances=instances)


def host_shapes(cluster: ClusterProfile) -> dict[HostShape, list[str]]:
    """Hosts grouped by shape (module docstring, step 1), each group in the profile's host order.

    The key holds each device's figures (model, memory GiB, TFLOP/s, GB/s, bf16, largest
    micro-batch, and whether the planner may use it: available for at least the planner's minimum
    residence, :attr:`PlanWorkload.min_residence_s <flexpipe_dag.planner.workload.PlanWorkload>`, from
    the profile's ``measured_at``), in device order, and the host's intra-host figures (without a
    topology: explicit links only, hosts of equal devices share a shape). The availability enters as
    that yes / no, not as the date: the planner reads nothing else of it, so spot hosts that each leave
    at their own time still share one plan. Measured pairs do not split a shape: :func:`plan_fleet`
    compares each unit's links with the template unit's, pair by pair, and plans a unit of its own
    where they differ.
    """
    by_host: dict[str, list[Device]] = {}
    for d in cluster.devices:
        by_host.setdefault(d.node_id, []).append(d)
    residence_s = PlanWorkload.min_residence_s  # the default plan_gear_set plans each unit with
    groups: dict[HostShape, list[str]] = {}
    for host_id, devices in by_host.items():
        figures = tuple((d.model_name, d.memory_gib, d.peak_tflops, d.hbm_bandwidth_gbps, d.bf16, d.max_micro_batch,
                         d.available_for_s(cluster.measured_at) >= residence_s,
                         tuple(sorted(d.op_timings_ms.items()))) for d in devices)
        if cluster.topology is not None:
            h = cluster.topology.host(host_id)
            position: tuple[object, ...] = (h.intra_kind, h.intra_bandwidth_gbps, h.intra_latency_us)
        else:  # explicit links only: hosts of equal devices share a shape; each unit's links are compared later
            position = ("links",)
        groups.setdefault((figures, position), []).append(host_id)
    return groups


def _units(cluster: ClusterProfile, host_ids: list[str], unit_hosts: int) -> tuple[list[tuple[str, ...]], list[str]]:
    """``host_ids`` cut into units of ``unit_hosts`` hosts of one rack, and the hosts left over."""
    by_rack: dict[object, list[str]] = {}
    for h in host_ids:
        rack = cluster.topology.host(h).rack_id if cluster.topology is not None else None
        by_rack.setdefault(rack, []).append(h)
    units: list[tuple[str, ...]] = []
    left: list[str] = []
    for hosts in by_rack.values():
        whole = len(hosts) - len(hosts) % unit_hosts
        units += [tuple(hosts[i:i + unit_hosts]) for i in range(0, whole, unit_hosts)]
        left += hosts[whole:]
    return units, left


def _devices_by_host(cluster: ClusterProfile) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for d in cluster.devices:
        out.setdefault(d.node_id, []).append(d.device_id)
    return out


def map_gear(gear: Gear, device_map: dict[str, str], gear_id: str) -> Gear:
    """A copy of ``gear`` with every device id mapped through ``device_map`` and the id ``gear_id``.

    Raises:
        InputError: a device of the gear missing from ``device_map``.
    """
    missing = [d for d in gear.device_ids if d not in device_map]
    if missing:
        raise InputError(gear.gear_id, "device_ids", f"no device to map {missing[:3]} to")
    stages = [StagePlan(**{**st.model_dump(), "device_ids": [device_map[d] for d in st.device_ids]})
              for st in gear.stages]
    return gear.model_copy(update={"gear_id": gear_id, "stages": stages})


@dataclass(frozen=True)
class FleetSettings:
    """What the instances are sized for.

    Attributes:
        slo_ttft_ms / slo_tpot_ms: the SLO each instance's envelope is measured against, ms.
        attainment: share of requests that must meet it (0..1].
        num_requests: requests of the reference trace per envelope probe.
        max_unit_hosts: most hosts one instance may span.
        concurrency / context_p95_tokens: the sequences in flight, of that many tokens each, an instance's KV
            pool must hold (the planner's; a unit whose memory cannot hold them serves nothing).
    """

    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0
    attainment: float = 0.95
    num_requests: int = 1000
    max_unit_hosts: int = MAX_UNIT_HOSTS
    concurrency: int = 64
    context_p95_tokens: int = 4096

    def __post_init__(self) -> None:
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            check_number(getattr(self, name), "fleet settings", name, gt=0, unit="ms")
        check_number(self.attainment, "fleet settings", "attainment", gt=0, le=1, unit="share of requests")
        check_number(self.num_requests, "fleet settings", "num_requests", integer=True, ge=2, le=10**7)
        check_number(self.max_unit_hosts, "fleet settings", "max_unit_hosts", integer=True, ge=1, le=MAX_UNIT_HOSTS)
        check_number(self.concurrency, "fleet settings", "concurrency", integer=True, ge=1, le=1_000_000)
        check_number(self.context_p95_tokens, "fleet settings", "context_p95_tokens", integer=True, ge=1, le=10**7)


def plan_template(cluster: ClusterProfile, spec: ModelSpec, unit: tuple[str, ...], reference: Workload, *,
                  dtype: str, settings: FleetSettings, shape: HostShape = ()) -> InstanceTemplate:
    """Plan and measure the operating gears on the hosts ``unit``; the best envelope per device is the template.

    Raises:
        InfeasibleError: the model does not fit the unit, or no gear meets the SLO at any rate there.
    """
    by_host = _devices_by_host(cluster)
    sub = cluster.restricted({d for h in unit for d in by_host[h]}, cluster_id=f"{cluster.cluster_id}-{unit[0]}")
    gear_set = plan_gear_set(sub, spec, dtype=dtype, concurrency=settings.concurrency,
                             context_p95_tokens=settings.context_p95_tokens)
    cm = make_search(sub, spec, dtype=dtype).cm
    envs = _best_confirmed(gear_set.gears, cm.timings, reference, settings)
    gears = apply_envelopes(gear_set.gears, [envs[g.gear_id] for g in gear_set.gears])
    serving = [g for g in gears if g.rps_max > 0 and math.isfinite(g.rps_max)]
    if not serving:
        raise InfeasibleError(f"no gear on {len(unit)} host(s) like {unit[0]} meets TTFT {settings.slo_ttft_ms:g} ms / "
                              f"TPOT {settings.slo_tpot_ms:g} ms for {settings.attainment:.0%} of requests at any rate")
    best = max(serving, key=lambda g: _per_device(g, g.rps_max))
    return InstanceTemplate(shape=shape, unit_host_ids=unit, gear=best, timing=cm.timings(best),
                            candidates=tuple((g.gear_id, len(g.device_ids), g.rps_max, envs[g.gear_id].confirmed)
                                             for g in gears))


def _per_device(gear: Gear, rps_max: float) -> tuple[float, float, str]:
    """A template's rank with the envelope ``rps_max`` (req/s): per device, then whole, then id (highest first)."""
    return rps_max / len(gear.device_ids), rps_max, gear.gear_id


def _best_confirmed(gears: Sequence[Gear], timing_of: Callable[[Gear], StageTimingModel], reference: Workload,
                    settings: FleetSettings) -> dict[str, GearEnvelope]:
    """Envelopes of ``gears`` by id: each measured on short probes, and only the best per device confirmed
    (:func:`~flexpipe_dag.planner.envelope.confirm_envelope`), again until the best is a confirmed one.

    A confirmation only lowers a top, so an unconfirmed gear's short-probe top bounds its confirmed one:
    the template chosen is the one confirming every gear would choose, at a third of the long probes.
    """
    probe: ProbeSettings = {"slo_ttft_ms": settings.slo_ttft_ms, "slo_tpot_ms": settings.slo_tpot_ms,
                            "attainment": settings.attainment, "num_requests": settings.num_requests}
    envs = {g.gear_id: measure_envelope(g, timing_of(g), reference, confirm=False, **probe) for g in gears}
    while True:
        serving = [g for g in gears if envs[g.gear_id].rps_max > 0 and math.isfinite(envs[g.gear_id].rps_max)]
        if not serving:
            return envs
        best = max(serving, key=lambda g: _per_device(g, envs[g.gear_id].rps_max))
        if envs[best.gear_id].confirmed:
            return envs
        envs[best.gear_id] = confirm_envelope(best, timing_of(best), reference, envs[best.gear_id], **probe)


def _link_figures(cluster: ClusterProfile, device_ids: list[str]) -> list[tuple[float, float] | None]:
    """Bandwidth and latency of every ordered pair of ``device_ids`` (None: not linked), in pair order."""
    out: list[tuple[float, float] | None] = []
    for a in device_ids:
        for b in device_ids:
            if a != b:
                link = cluster.link(a, b)
                out.append(None if link is None else (link.bandwidth_gbps, link.latency_us))
    return out


def _add_instances(cluster: ClusterProfile, spec: ModelSpec, reference: Workload, dtype: str, settings: FleetSettings,
                   template: InstanceTemplate, units: list[tuple[str, ...]], by_host: dict[str, list[str]],
                   templates: list[InstanceTemplate], instances: list[FleetInstance]) -> None:
    """One instance per unit: the template mapped onto the unit's devices when the unit's links equal the
    template unit's (pair by pair), else a plan of the unit's own (its links differ: measured pairs, or a
    profile without a topology). Appends to ``templates`` and ``instances``."""
    t_index = len(templates)
    templates.append(template)
    src = [d for h in template.unit_host_ids for d in by_host[h]]
    src_links = _link_figures(cluster, src)
    for unit in units:
        dst = [d for h in unit for d in by_host[h]]
        index, own = t_index, template
        if unit != template.unit_host_ids and _link_figures(cluster, dst) != src_links:
            try:
                own = plan_template(cluster, spec, unit, reference, dtype=dtype, settings=settings, shape=template.shape)
            except InfeasibleError:
                continue
            index = len(templates)
            templates.append(own)
            gear = own.gear.model_copy(update={"gear_id": f"{unit[0]}-{own.gear.kind}"})
        else:
            gear = map_gear(template.gear, dict(zip(src, dst)), f"{unit[0]}-{template.gear.kind}")
        instances.append(FleetInstance(instance_id=f"{unit[0]}-{own.gear.kind}", host_ids=unit, gear=gear,
                                       template=index))


def plan_fleet(cluster: ClusterProfile, spec: ModelSpec, reference: Workload, *, dtype: str = "bf16",
               settings: FleetSettings | None = None) -> FleetPlan:
    """Plan every pipeline instance of ``cluster`` for ``spec`` (the module docstring's four steps).

    Args:
        reference: the trace the envelopes are measured on (e.g. ``load_trace("azure-conv")``).
        settings: SLO, attainment and unit limits (defaults: TTFT 2 s, TPOT 200 ms, 95 %).

    Returns:
        The :class:`FleetPlan`; its cost is one plan and one envelope measurement per host shape.

    Raises:
        InfeasibleError: no host shape serves the model within the SLO (each shape's reason listed).
    """
    settings = settings or FleetSettings()
    by_host = _devices_by_host(cluster)
    templates: list[InstanceTemplate] = []
    instances: list[FleetInstance] = []
    notes: list[str] = []
    for shape, hosts in host_shapes(cluster).items():
        template, reasons = None, []
        unit_hosts = 1
        while unit_hosts <= min(settings.max_unit_hosts, len(hosts)):
            units, _ = _units(cluster, hosts, unit_hosts)
            if not units:  # racks are fixed: none holds a larger unit either
                reasons.append(f"{unit_hosts} host(s): no rack holds {unit_hosts} of these hosts")
                break
            try:
                template = plan_template(cluster, spec, units[0], reference, dtype=dtype, settings=settings,
                                         shape=shape)
                break
            except InfeasibleError as exc:
                reasons.append(f"{unit_hosts} host(s): {exc}")
            unit_hosts *= 2
        if template is None:
            notes.append(f"{len(hosts)} host(s) like {hosts[0]} serve nothing: "
                         + ("; ".join(reasons) if reasons else "no rack holds enough of them for one instance"))
            continue
        units, left = _units(cluster, hosts, template.unit_hosts)
        if left:
            notes.append(f"{len(left)} host(s) like {hosts[0]} serve nothing: a unit takes {template.unit_hosts} "
                         f"hosts of one rack ({', '.join(left[:4])}{', ...' if len(left) > 4 else ''})")
        used = template.num_devices
        per_unit = sum(len(by_host[h]) for h in template.unit_host_ids)
        if used < per_unit:
            notes.append(f"instances like {template.unit_host_ids[0]} use {used} of their {per_unit} devices "
                         f"(the rest add no envelope per device: {template.gear.gear_id})")
        _add_instances(cluster, spec, reference, dtype, settings, template, units, by_host, templates, instances)
    leaving = sorted({d.node_id for d in cluster.devices if d.available_until is not None})
    if leaving:
        notes.append(f"{len(leaving)} host(s) have devices that leave ({', '.join(leaving[:4])}"
                     f"{', ...' if len(leaving) > 4 else ''}): instances are planned and simulated as if they stay")
    if not instances:
        raise InfeasibleError(f"no host of {cluster.cluster_id} serves {spec.name}: " + " | ".join(notes))
    instances.sort(key=lambda i: (-i.rps_max / max(1, i.num_devices), -i.rps_max, i.instance_id))
    return FleetPlan(cluster_id=cluster.cluster_id, templates=tuple(templates), instances=tuple(instances),
                     notes=tuple(notes))


def describe_plan(plan: FleetPlan) -> list[dict[str, object]]:
    """One row per template for tables: shape's first host, units, devices per instance, envelope, req/s per device."""
    counts: dict[int, int] = {}
    for inst in plan.instances:
        counts[inst.template] = counts.get(inst.template, 0) + 1
    rows: list[dict[str, object]] = []
    for i, t in enumerate(plan.templates):
        rows.append({"like_host": t.unit_host_ids[0], "instances": counts.get(i, 0), "hosts_per_instance": t.unit_hosts,
                     "devices_per_instance": t.num_devices, "stages": t.gear.num_stages,
                     "micro_batch_size": t.gear.micro_batch_size, "rps_max": round(t.rps_max, 3),
                     "rps_per_device": round(t.rps_per_device, 4)})
    return rows

