"""Live fleet gears: a fleet plan's instances served on one router, scaled out and in by the fleet scaler.

The live counterpart of :mod:`flexpipe_dag.control.fleet_day`. :class:`FleetController` holds an
:class:`~flexpipe_dag.shift.instances.InstanceFleet` (one router, several live pipelines) and a
:class:`~flexpipe_dag.planner.fleet.FleetPlan`; at each sample it feeds the request rate the router
accepted, and the requests queued beyond what the serving instances run at once, to the
:class:`~flexpipe_dag.control.fleet_scaler.FleetScaler` (smoothing, hysteresis, dwell, payback,
forecast) and applies its decision:

* scale out to ``n'`` instances: the plan's instances ``n..n'-1`` are started in order, each warmed up
  and checked against a live instance before it is routed to (:meth:`InstanceFleet.add_instance`);
* scale in to ``n'``: instances ``n-1`` down to ``n'`` are withdrawn (no new request reaches them),
  drained and shut down (:meth:`InstanceFleet.remove_instance`); what they hold finishes there, or
  moves to the others if one fails or outlives the drain deadline. Nothing is lost.

A start that fails leaves the fleet as it was (the scaler's state is not advanced past what is
serving), and the failure is recorded in :attr:`FleetController.errors`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from flexpipe_dag.control.controller import ForecastFn
from flexpipe_dag.control.fleet_scaler import (
    FleetDecision,
    FleetScaler,
    FleetScalerConfig,
    FleetScalerState,
)
from flexpipe_dag.core.errors import FlexPipeError, InputError

if TYPE_CHECKING:  # pragma: no cover
    from flexpipe_dag.planner.fleet import FleetInstance, FleetPlan
    from flexpipe_dag.runtime.pipeline import RuntimeOptions
    from flexpipe_dag.shift.instances import InstanceFleet

_COUNTED = ("held", "pending", "finished", "refused", "failed", "cancelled")


class FleetController:
    """Scales ``fleet`` over ``plan``'s instances (module docstring).

    Args:
        options_for: runtime options per plan instance (e.g. its devices' Ray placement); None: the fleet's.
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(self, fleet: InstanceFleet, plan: FleetPlan, config: FleetScalerConfig | None = None, *,
                 forecast: ForecastFn | None = None,
                 options_for: Callable[[FleetInstance], RuntimeOptions | None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.fleet, self.plan = fleet, plan
        self.scaler = FleetScaler(plan, config)
        self.forecast = forecast
        self.options_for = options_for or (lambda _inst: None)
        self.clock = clock
        self.state: FleetScalerState | None = None
        self.lane_ids: list[str] = []          # the live instance of plan index i is lane_ids[i]
        self.decisions: list[FleetDecision] = []
        self.errors: list[str] = []
        self._retry_after_s = -float("inf")    # no new start before this (clock s) after one failed
        self._last_count = 0
        self._last_t = clock()

    def _accepted(self) -> int:
        counts = self.fleet.router.ledger.counts()
        return sum(counts[s] for s in _COUNTED)

    def observed_rps(self) -> float:
        """Caller requests the router accepted since the last call, per second of the clock."""
        now, count = self.clock(), self._accepted()
        elapsed = max(now - self._last_t, 1e-9)
        rps = (count - self._last_count) / elapsed
        self._last_t, self._last_count = now, count
        return rps

    def queued(self) -> int:
        """Requests open on the router beyond what the serving instances run at once (each gear's
        micro-batch size x micro-batches in flight): the queue the scaler sizes a drain for."""
        running = sum(inst.gear.micro_batch_size * inst.gear.max_inflight_micro_batches
                      for inst in self.plan.instances[:len(self.lane_ids)])
        return max(0, self.fleet.router.ledger.num_open() - running)

    def start(self, rps: float) -> list[str]:
        """Start the instances ``rps`` req/s needs (at least one); returns their instance ids.

        Raises:
            InputError: already started. FlexPipeError: the first instance cannot start (nothing serves).
        """
        if self.state is not None:
            raise InputError("fleet controller", "start", "already started")
        state = self.scaler.initial_state(rps)
        self._grow(state.instances)
        if not self.lane_ids:
            raise FlexPipeError("fleet controller: no instance started: " + "; ".join(self.errors))
        self._begin()
        return list(self.lane_ids)

    def _begin(self) -> None:
        """The scaler's state for the instances in :attr:`lane_ids`; the request rate counts from now."""
        self.state = FleetScalerState(instances=len(self.lane_ids))
        self._last_t, self._last_count = self.clock(), self._accepted()

    def adopt(self, lane_ids: list[str]) -> None:
        """Take over instances already serving on the router as the plan's first ``len(lane_ids)`` instances
        (in that order; e.g. a server's entry point and the instances it started itself), instead of
        :meth:`start`. Scaling in never removes ``lane_ids[0]``.

        Raises:
            InputError: already started, no lane or more lanes than the plan has instances, or a lane the
                router does not route requests to.
        """
        if self.state is not None:
            raise InputError("fleet controller", "adopt", "already started")
        if not 1 <= len(lane_ids) <= len(self.plan.instances):
            raise InputError("fleet controller", "lane_ids", f"got {len(lane_ids)} lanes; expected "
                             f"1..{len(self.plan.instances)} (the plan's instances)")
        routed = [ln.lane_id for ln in self.fleet.router.instances]
        stray = [lid for lid in lane_ids if lid not in routed]
        if stray:
            raise InputError("fleet controller", "lane_ids", f"{stray} are not serving; the router routes to {routed}")
        self.lane_ids = list(lane_ids)
        self._begin()

    def _grow(self, target: int) -> None:
        while len(self.lane_ids) < target:
            inst = self.plan.instances[len(self.lane_ids)]
            try:
                self.lane_ids.append(self.fleet.add_instance(inst.gear, self.options_for(inst)))
            except FlexPipeError as exc:
                self.errors.append(f"instance {inst.instance_id} did not start: {exc}")
                return

    def _shrink(self, target: int, drain_timeout_s: float | None) -> None:
        while len(self.lane_ids) > max(1, target):
            self.fleet.remove_instance(self.lane_ids.pop(), drain_timeout_s=drain_timeout_s)

    def step(self, t_s: float | None = None, rps: float | None = None, *,
             drain_timeout_s: float | None = None) -> FleetDecision:
        """One sample: decide on ``rps`` (default :meth:`observed_rps`) at ``t_s`` (default the clock) and apply it.

        Raises:
            InputError: not started.
        """
        if self.state is None:
            raise InputError("fleet controller", "step", "call start() first")
        t = self.clock() if t_s is None else t_s
        rate = self.observed_rps() if rps is None else rps
        state, decision = self.scaler.decide(self.state, t, rate, self.forecast, queued=float(self.queued()))
        if decision.to_instances > decision.from_instances and t >= self._retry_after_s:
            failed = len(self.errors)
            self._grow(decision.to_instances)
            if len(self.errors) > failed:  # the same start would fail again at once: retry after one warm-up
                self._retry_after_s = t + max(self.scaler.config.instance_warmup_s, self.scaler.config.sample_period_s)
        elif decision.to_instances < decision.from_instances:
            self._shrink(decision.to_instances, drain_timeout_s)
        if len(self.lane_ids) != decision.to_instances:  # a start failed or waits: the scaler counts what serves
            state = replace(state, instances=len(self.lane_ids), out_count=0, in_count=0, over_count=0)
        self.state = state
        if decision.changed:
            self.decisions.append(decision)
        return decision

    def run(self, stop: threading.Event) -> None:
        """Sample every ``sample_period_s`` until ``stop`` is set (run it in a thread)."""
        period = self.scaler.config.sample_period_s
        while not stop.wait(period):
            self.step()
