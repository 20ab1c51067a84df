"""Several pipeline instances behind one router, request by request (the exact fleet simulator).

Each instance is its own :class:`~flexpipe_dag.sim.engine.Simulator` (its own gear, stage times, KV
pool, continuous batching). Requests arrive in order; at each arrival every instance is simulated up
to that instant and the request is routed:

* **KV-aware admission**: only to an instance whose KV pool can ever hold the request
  (``input + output`` tokens; an instance with an unbounded pool holds any); when none can, to the one
  with the largest pool, whose simulator then rejects it (counted, never silently dropped);
* **least outstanding work per unit of capacity**: among those, the instance with the fewest open
  requests (queued + running) per req/s of envelope, ``(open + 1) / rps_max`` (ties: the earlier
  instance). On instances of different sizes this fills each in proportion to what it serves.

Instances are added and removed at given times (:class:`InstanceChange`): an added instance holds its
devices from ``at_s`` and admits from ``at_s + ready_in_s`` (its warm-up); a removed one admits
nothing from ``at_s`` and keeps its devices until its last request finishes (its drain). No request is
moved between instances, so nothing is lost or served twice by a change.

Cost: every arrival advances every admitting instance, O(requests x instances) calls; this is the
reference the fluid day model (:mod:`flexpipe_dag.control.fleet_day`) is checked against, on small
fleets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear import Gear
from flexpipe_dag.core.timing import StageTimingModel
from flexpipe_dag.sim.config import SimConfig
from flexpipe_dag.sim.engine import Simulator
from flexpipe_dag.workload.request import Request, Workload


@dataclass(frozen=True)
class InstanceChange:
    """Add or remove one instance at ``at_s`` (simulated seconds).

    Attributes:
        kind: ``"add"`` (``gear`` and ``timing`` required; admits from ``at_s + ready_in_s``) or ``"remove"``.
        rps_max: the instance's envelope, req/s (the router's capacity weight); default the gear's.
    """

    at_s: float
    kind: Literal["add", "remove"]
    instance_id: str
    gear: Gear | None = None
    timing: StageTimingModel | None = None
    ready_in_s: float = 0.0
    rps_max: float | None = None


@dataclass
class _Member:
    instance_id: str
    sim: Simulator
    rps_max: float
    devices: int
    added_s: float
    ready_s: float
    removed_s: float | None = None

    def admits(self, t_s: float) -> bool:
        return self.ready_s <= t_s and (self.removed_s is None or t_s < self.removed_s)


@dataclass(frozen=True)
class FleetSimResult:
    """What the fleet did.

    Attributes:
        requests: one row per request: ``request_id``, ``instance_id``, ``arrival_s``, ``finish_s``,
            ``ttft_ms``, ``tpot_ms``, ``slo_met``, ``rejected`` (arrival order).
        instances: one row per instance: ``instance_id``, ``devices``, ``added_s``, ``ready_s``,
            ``removed_s``, ``held_until_s`` (its last finish, or the end), ``requests``,
            ``device_hours``.
        end_s: when the run ended (the last finish or ``until_s``).
    """

    requests: pd.DataFrame
    instances: pd.DataFrame
    end_s: float

    def slo_attainment(self, first_index: int = 0) -> float:
        """Share of requests ``first_index..`` (arrival order) meeting the SLO; rejected ones count as misses."""
        met = self.requests["slo_met"].to_numpy(dtype=bool)[first_index:]
        return float(met.mean()) if met.size else math.nan

    @property
    def device_hours(self) -> float:
        return float(self.instances["device_hours"].sum())

    @property
    def lost(self) -> int:
        """Requests rejected or never finished."""
        r = self.requests
        return int(r["rejected"].sum() + (r["finish_s"].isna() & ~r["rejected"]).sum())


class FleetSimulator:
    """Instances behind one router (module docstring), for one workload.

    Raises:
        InputError: a change names an unknown instance, adds one twice, lacks a gear / timing, or is not
            in time order.
    """

    def __init__(self, config: SimConfig | None = None):
        self.config = config or SimConfig()
        self._members: dict[str, _Member] = {}
        self._owner: dict[str, str] = {}  # request id -> instance id

    def _apply(self, change: InstanceChange) -> None:
        if change.kind == "add":
            if change.instance_id in self._members:
                raise InputError("fleet simulation", "changes", f"instance {change.instance_id!r} is added twice")
            if change.gear is None or change.timing is None:
                raise InputError("fleet simulation", "changes",
                                 f"adding {change.instance_id!r} needs its gear and stage timing")
            if change.ready_in_s < 0:
                raise InputError("fleet simulation", "ready_in_s", f"got {change.ready_in_s}; expected >= 0")
            sim = Simulator(Workload(name=change.instance_id, requests=()), change.gear, change.timing, self.config)
            sim.advance(change.at_s)
            rps = change.rps_max if change.rps_max is not None else change.gear.rps_max
            self._members[change.instance_id] = _Member(
                change.instance_id, sim, rps if math.isfinite(rps) and rps > 0 else 1.0, len(change.gear.device_ids),
                change.at_s, change.at_s + change.ready_in_s)
        else:
            member = self._members.get(change.instance_id)
            if member is None or member.removed_s is not None:
                raise InputError("fleet simulation", "changes",
                                 f"instance {change.instance_id!r} is not serving; cannot remove it")
            member.removed_s = change.at_s

    def _route(self, r: Request) -> _Member:
        t = r.arrival_s
        open_now = [m for m in self._members.values() if m.admits(t)]
        if not open_now:  # everything warming: the earliest ready instance queues it
            open_now = [min((m for m in self._members.values() if m.removed_s is None),
                            key=lambda m: (m.ready_s, m.instance_id))]
        need = r.input_tokens + r.output_tokens
        fits = [m for m in open_now if m.sim.kv_capacity_tokens == 0 or m.sim.kv_capacity_tokens >= need]
        if not fits:
            return max(open_now, key=lambda m: m.sim.kv_capacity_tokens)
        for m in fits:
            m.sim.advance(t)
        return min(fits, key=lambda m: (m.sim.open_requests + 1) / m.rps_max)

    def run(self, workload: Workload, changes: Sequence[InstanceChange], *, until_s: float | None = None) -> FleetSimResult:
        """Serve ``workload`` with the instances ``changes`` add and remove (at least one added at or before
        the first arrival); run until every request finished (or ``until_s``)."""
        pending = sorted(changes, key=lambda c: c.at_s)
        if not pending or pending[0].kind != "add":
            raise InputError("fleet simulation", "changes", "expected the first change to add an instance")
        k = 0
        for r in workload.requests:
            while k < len(pending) and pending[k].at_s <= r.arrival_s:
                self._apply(pending[k])
                k += 1
            m = self._route(r)
            if m.sim.now_s < r.arrival_s:
                m.sim.advance(r.arrival_s)
            m.sim.submit([r])
            self._owner[r.request_id] = m.instance_id
        while k < len(pending):
            self._apply(pending[k])
            k += 1
        horizon = math.inf if until_s is None else until_s
        for m in self._members.values():
            if math.isinf(horizon):
                m.sim.run()
            else:
                m.sim.advance(horizon)
        return self._result(workload, until_s)

    def _result(self, workload: Workload, until_s: float | None) -> FleetSimResult:
        frames = []
        rows = []
        end_s = max([until_s or 0.0] + [r.arrival_s for r in workload.requests])
        for m in self._members.values():
            df = m.sim.result().requests
            df = df.assign(instance_id=m.instance_id)
            frames.append(df)
            last = float(df["finish_s"].max()) if len(df) and df["finish_s"].notna().any() else m.added_s
            end_s = max(end_s, last)
            rows.append((m, df, last))
        inst = []
        for m, df, last in rows:
            held = max(last, m.removed_s) if m.removed_s is not None else end_s
            inst.append({"instance_id": m.instance_id, "devices": m.devices, "added_s": m.added_s, "ready_s": m.ready_s,
                         "removed_s": m.removed_s, "held_until_s": held, "requests": len(df),
                         "device_hours": m.devices * max(0.0, held - m.added_s) / 3600.0})
        cols = ["request_id", "instance_id", "arrival_s", "finish_s", "ttft_ms", "tpot_ms", "slo_met", "rejected"]
        requests = pd.concat(frames, ignore_index=True)[cols] if frames else pd.DataFrame(columns=cols)
        order = {r.request_id: i for i, r in enumerate(workload.requests)}
        requests = requests.assign(_order=requests["request_id"].map(order)).sort_values("_order", kind="stable")
        requests = requests.drop(columns="_order").reset_index(drop=True)
        requests["slo_met"] = requests["slo_met"].astype(bool) & ~requests["rejected"].astype(bool)
        return FleetSimResult(requests=requests, instances=pd.DataFrame(inst), end_s=end_s)


def attainment_after(result: FleetSimResult, warmup_s: float) -> float:
    """SLO attainment of the requests arriving at or after ``warmup_s``."""
    arrival = result.requests["arrival_s"].to_numpy(dtype=float)
    met = result.requests["slo_met"].to_numpy(dtype=bool)[arrival >= warmup_s]
    return float(np.mean(met)) if met.size else math.nan
