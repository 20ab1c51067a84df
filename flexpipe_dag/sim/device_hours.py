"""Device accounting for a serving run: which gear's devices were held when, and device-hours in all.

DistServe (OSDI'24) scores a serving system by *goodput per GPU*: on a fragmented fleet a gear that
serves the day's peak on every device holds them all day, while a shifting pipeline can run the
troughs on fewer devices and hand the rest back (to offline batch work). This module turns a run's
gear timeline into the devices it held over time (pure; plain data in, plain data out).

Timeline rules (the simulator's :class:`~flexpipe_dag.sim.engine.ShiftEvent` records carry every
time needed):

* the starting gear's devices are held from ``start_s``;
* a shift's new gear holds its devices from ``requested_s`` (its shadow warm-up starts then: weights
  move onto its devices before it admits at ``switched_s``);
* the old gear keeps its devices until ``drained_s``, when its last running sequence finishes
  (``None``: still draining at the end, so held until ``end_s``);
* the gear admitting at the end holds its devices until ``end_s``.

While a warm-up or a drain overlaps, both gears' devices are held; a device that serves in both is
one device and counts once (the *union* of device ids is held at every instant). Every interval is
clipped to ``[start_s, end_s]``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from flexpipe_dag.core.errors import InputError

_SOURCE = "device accounting"


class ShiftLike(Protocol):
    """What a shift record must carry, read-only (:class:`~flexpipe_dag.sim.results.ShiftEvent`, frozen, does)."""

    @property
    def requested_s(self) -> float: ...
    @property
    def switched_s(self) -> float: ...
    @property
    def from_gear_id(self) -> str: ...
    @property
    def to_gear_id(self) -> str: ...
    @property
    def drained_s(self) -> float | None: ...


@dataclass(frozen=True)
class GearHold:
    """One gear holding its devices over ``[start_s, end_s]`` (simulated seconds)."""

    gear_id: str
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class DeviceSpan:
    """Over ``[start_s, end_s]`` exactly the devices in ``device_ids`` are held."""

    start_s: float
    end_s: float
    device_ids: frozenset[str]

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)


def _finite(value: float, field: str) -> float:
    v = float(value)
    if not math.isfinite(v):
        raise InputError(_SOURCE, field, f"got {value!r}; expected a finite time in seconds")
    return v


def gear_holds(start_gear_id: str, shifts: Sequence[ShiftLike], *, end_s: float, start_s: float = 0.0) -> list[GearHold]:
    """The interval over which each gear of a run holds its devices (rules in the module doc).

    Args:
        start_gear_id: the gear serving from ``start_s``.
        shifts: the run's shifts (e.g. ``SimResult.shifts``), any order; sorted by ``switched_s``.
        end_s: when the run stops holding devices (e.g. the last request's finish), seconds.
        start_s: when the run starts holding devices, seconds (default 0).

    Returns:
        One :class:`GearHold` per gear residence, in the order the gears started admitting; a gear
        shifted to twice appears twice. Intervals are clipped to ``[start_s, end_s]``.

    Raises:
        InputError: non-finite times, ``end_s < start_s``, a shift with ``switched_s <
        requested_s`` or ``drained_s < switched_s``, or shifts that do not chain (a shift's
        ``from_gear_id`` is not the gear admitting before it).
    """
    start_s = _finite(start_s, "start_s")
    end_s = _finite(end_s, "end_s")
    if end_s < start_s:
        raise InputError(_SOURCE, "end_s", f"got {end_s}; expected >= start_s {start_s}")
    ordered = sorted(shifts, key=lambda e: (float(e.switched_s), float(e.requested_s)))
    for i, ev in enumerate(ordered):
        req = _finite(ev.requested_s, f"shifts[{i}].requested_s")
        sw = _finite(ev.switched_s, f"shifts[{i}].switched_s")
        if sw < req:
            raise InputError(_SOURCE, f"shifts[{i}].switched_s", f"got {sw}; expected >= requested_s {req}")
        if ev.drained_s is not None and _finite(ev.drained_s, f"shifts[{i}].drained_s") < sw:
            raise InputError(_SOURCE, f"shifts[{i}].drained_s", f"got {ev.drained_s}; expected >= switched_s {sw}")
        admitting = start_gear_id if i == 0 else ordered[i - 1].to_gear_id
        if ev.from_gear_id != admitting:
            raise InputError(_SOURCE, f"shifts[{i}].from_gear_id",
                             f"got {ev.from_gear_id!r}; expected {admitting!r}, the gear admitting before this shift")

    def clip(t: float) -> float:
        return min(max(t, start_s), end_s)

    holds = []
    for k in range(len(ordered) + 1):
        gear_id = start_gear_id if k == 0 else ordered[k - 1].to_gear_id
        since = start_s if k == 0 else float(ordered[k - 1].requested_s)
        until = end_s
        drained_s = ordered[k].drained_s if k < len(ordered) else None
        if drained_s is not None:
            until = float(drained_s)
        holds.append(GearHold(gear_id, clip(since), clip(until)))
    return holds


def device_spans(holds: Sequence[GearHold], devices_by_gear: Mapping[str, Collection[str]]) -> list[DeviceSpan]:
    """The set of devices held over time: the union of the devices of every gear holding at each instant.

    Args:
        holds: gear intervals (e.g. from :func:`gear_holds`).
        devices_by_gear: each gear's device ids (e.g. ``{g.gear_id: g.device_ids}``).

    Returns:
        Consecutive spans, in time order, covering every instant some gear holds (spans where nothing
        is held are left out); adjacent spans with the same device set are merged.

    Raises:
        InputError: a hold names a gear missing from ``devices_by_gear``, or ends before it starts.
    """
    for i, h in enumerate(holds):
        if h.gear_id not in devices_by_gear:
            raise InputError(_SOURCE, f"holds[{i}].gear_id",
                             f"gear {h.gear_id!r} has no device list (known: {', '.join(sorted(devices_by_gear))})")
        if h.end_s < h.start_s:
            raise InputError(_SOURCE, f"holds[{i}].end_s", f"got {h.end_s}; expected >= start_s {h.start_s}")
    cuts = sorted({t for h in holds for t in (h.start_s, h.end_s)})
    spans: list[DeviceSpan] = []
    for a, b in zip(cuts, cuts[1:]):
        held = frozenset(d for h in holds if h.start_s <= a and h.end_s >= b for d in devices_by_gear[h.gear_id])
        if not held:
            continue
        if spans and spans[-1].end_s == a and spans[-1].device_ids == held:
            spans[-1] = DeviceSpan(spans[-1].start_s, b, held)
        else:
            spans.append(DeviceSpan(a, b, held))
    return spans


def device_hours(spans: Sequence[DeviceSpan]) -> float:
    """Device-hours held: the sum over spans of devices x duration, in hours (1 device for 3600 s = 1.0)."""
    return sum(s.num_devices * (s.end_s - s.start_s) for s in spans) / 3600.0


@dataclass(frozen=True)
class DeviceUsage:
    """What a run held: its gear intervals, the device spans, and the totals.

    Attributes:
        holds: per gear residence, when its devices were held.
        spans: the union of held devices over time.
        device_hours: devices x hours held.
        horizon_s: ``end_s - start_s``, seconds.
        peak_devices: the most devices held at once.
    """

    holds: tuple[GearHold, ...]
    spans: tuple[DeviceSpan, ...]
    device_hours: float
    horizon_s: float
    peak_devices: int

    @property
    def mean_devices(self) -> float:
        """Time-averaged devices held over the horizon (0 for an empty horizon)."""
        return self.device_hours * 3600.0 / self.horizon_s if self.horizon_s > 0 else 0.0

    def per_device_hour(self, count: float) -> float:
        """``count`` (e.g. requests within SLO) per device-hour held; ``inf`` if none were held and count > 0."""
        if self.device_hours > 0:
            return count / self.device_hours
        return math.inf if count > 0 else 0.0


def device_usage(start_gear_id: str, shifts: Sequence[ShiftLike], devices_by_gear: Mapping[str, Collection[str]], *,
                 end_s: float, start_s: float = 0.0) -> DeviceUsage:
    """Device accounting of one run: :func:`gear_holds`, then :func:`device_spans` and :func:`device_hours`.

    A run that never shifts holds its gear's devices for the whole ``[start_s, end_s]``.

    Raises:
        InputError: as :func:`gear_holds` and :func:`device_spans`.
    """
    holds = gear_holds(start_gear_id, shifts, end_s=end_s, start_s=start_s)
    spans = device_spans(holds, devices_by_gear)
    return DeviceUsage(holds=tuple(holds), spans=tuple(spans), device_hours=device_hours(spans),
                       horizon_s=float(end_s) - float(start_s),
                       peak_devices=max((s.num_devices for s in spans), default=0))
