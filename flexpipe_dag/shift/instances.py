"""Several pipeline instances on one host behind one router: add one under load, remove one without loss.

:class:`InstanceFleet` manages the live instances (one :class:`~flexpipe_dag.runtime.pipeline.PipelineRuntime`
each, in a :class:`~flexpipe_dag.shift.lane.Lane`) of one :class:`~flexpipe_dag.shift.router.ServingRouter`;
the router routes every request to the instance with the least outstanding work whose context and KV
pool can hold it, and its :class:`~flexpipe_dag.shift.ledger.RequestLedger` delivers each output
exactly once. This module adds only the life cycle:

* :meth:`InstanceFleet.add_instance` starts a gear's pipeline beside the live ones, warms it up and
  checks its greedy answer against a live instance's (the shift executor's steps 1-2,
  :meth:`~flexpipe_dag.shift.executor.GearExecutor.start_warm_lane`), then adds it to the routing set
  in one step under the router's lock. Requests in flight elsewhere are not touched.
* :meth:`InstanceFleet.remove_instance` takes an instance out of the routing set (atomically: no new
  request reaches it afterwards), lets it drain (what it holds finishes there), then shuts its
  processes down. If it fails while draining, or has not drained within the deadline, the router
  re-submits its unfinished requests to the other instances (outputs it already delivered are not
  repeated; one that finishes twice in a race is delivered once).

A gear shift of the entry point (:class:`~flexpipe_dag.shift.executor.GearExecutor`, :attr:`InstanceFleet.executor`)
works beside them: the other instances keep serving while it runs.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flexpipe_dag.core.errors import InfeasibleError
from flexpipe_dag.shift.executor import GearExecutor, ShiftConfig
from flexpipe_dag.shift.residency import plan_residency

if TYPE_CHECKING:  # pragma: no cover
    from flexpipe_dag.core.gear import Gear
    from flexpipe_dag.runtime.model_loader import Checkpoint
    from flexpipe_dag.runtime.pipeline import RuntimeOptions
    from flexpipe_dag.shift.lane import Lane
    from flexpipe_dag.shift.router import ServingRouter

#: How often :meth:`InstanceFleet.remove_instance` checks whether the instance drained, seconds.
DRAIN_POLL_S = 0.02


@dataclass(frozen=True)
class InstanceStatus:
    """One live instance as the router sees it now.

    Attributes:
        instance_id: its lane id, ``"<gear_id>#<n>"``.
        gear_id: the gear it runs.
        num_stages: pipeline stages (processes, replicas not counted).
        entry_point: whether it is the router's entry point (the instance a gear shift moves).
        longest_request_tokens: prompt + ``max_new_tokens`` of the longest request it can hold.
        open_requests: caller requests it holds now.
        open_work_tokens: prompt + ``max_new_tokens`` of every request (caller or probe) it holds now.
        requests_admitted: caller requests ever sent to it (moves included).
        requests_finished: caller requests whose delivered output came from it.
    """

    instance_id: str
    gear_id: str
    num_stages: int
    entry_point: bool
    longest_request_tokens: int
    open_requests: int
    open_work_tokens: int
    requests_admitted: int
    requests_finished: int


@dataclass(frozen=True)
class InstanceRemoval:
    """What :meth:`InstanceFleet.remove_instance` did.

    Attributes:
        instance_id: the removed instance.
        drained: every request it held finished there (no move was needed).
        requests_moved: caller requests it was given and did not finish itself: re-submitted to the other
            instances (a drain timeout or a failure) or refused.
        drain_s: seconds from leaving the routing set until it held nothing (or was stopped).
        total_s: seconds for the whole removal, the shutdown of its processes included.
    """

    instance_id: str
    drained: bool
    requests_moved: int
    drain_s: float
    total_s: float


class InstanceFleet:
    """The pipeline instances behind one :class:`ServingRouter`, added and removed while it serves.

    Args:
        router: the serving front; requests go through its :meth:`~ServingRouter.submit` as always.
        model: a :class:`~flexpipe_dag.runtime.model_loader.Checkpoint`, a source for
            :func:`~flexpipe_dag.runtime.model_loader.resolve_checkpoint`, or ``None`` (SmolLM2); every
            instance serves this model.
        options: runtime options of new instances (default: the runtime's defaults).
        config: warm-up, verify and deadline figures (:class:`ShiftConfig`: ``warmup_requests``,
            ``warmup_max_new_tokens``, ``warmup_timeout_s``, ``drain_timeout_s``, ``release_timeout_s``).

    Attributes:
        executor: the :class:`GearExecutor` that starts instances; its :meth:`~GearExecutor.shift` moves
            the entry point to another gear while the other instances serve.
    """

    def __init__(self, router: ServingRouter, model: Checkpoint | str | os.PathLike | None = None,
                 options: RuntimeOptions | None = None, config: ShiftConfig | None = None):
        from flexpipe_dag.runtime.model_loader import Checkpoint, resolve_checkpoint

        self.router = router
        self.ckpt = model if isinstance(model, Checkpoint) else resolve_checkpoint(model)
        self.options = options
        self.config = config or ShiftConfig()
        self.executor = GearExecutor(router, self.config, options)
        self._start_lock = threading.Lock()  # instances start one at a time (each warm-up has its deadline)

    def add_instance(self, gear: Gear, options: RuntimeOptions | None = None) -> str:
        """Start ``gear``'s pipeline, warm it up, verify its greedy answer against the entry point's (when
        one serves), then route requests to it too. Safe under load: nothing in flight moves.

        Args:
            gear: the instance's gear (stages, micro-batch size, KV pool); same model as the fleet.
            options: runtime options for this instance only (default: the fleet's).

        Returns the new instance's id.

        Raises:
            InputError, InfeasibleError: the gear does not fit its devices, alone or beside the live
                instances (:meth:`check_room`; nothing started).
            FlexPipeError: it did not start, warm up or verify within ``config.warmup_timeout_s`` (its
                processes are stopped, routing is unchanged; the message names the step).
        """
        from flexpipe_dag.runtime.pipeline import RuntimeOptions

        opts = options or self.options or RuntimeOptions()
        with self._start_lock:
            self.check_room(gear, opts)
            reference = self.router.active
            lane = self.executor.start_warm_lane(gear, self.ckpt, opts,
                                                 reference if reference is not None and reference.alive else None)
            try:
                self.router.route_to(lane)
            except BaseException:
                lane.force_stop()
                raise
            return lane.lane_id

    def check_room(self, gear: Gear, options: RuntimeOptions) -> None:
        """Refuse a gear whose weights and full KV pool do not fit beside every live pipeline of the router
        (each memory pool: a device of ``options.device_memory_bytes``, or this host's memory shared by the
        others, less ``config.memory_reserve_fraction``; :func:`~flexpipe_dag.shift.residency.plan_residency`).

        Raises:
            InfeasibleError: naming the pool that is short and the live instances it holds.
        """
        from flexpipe_dag.core.host import host_memory_bytes
        from flexpipe_dag.runtime.pipeline import kv_num_blocks, stage_memory_bytes

        live = [lane for lane in self.router.lanes if lane.alive]
        if not live:
            return
        live_rows = [row for lane in live for row in stage_memory_bytes(lane.gear, self.ckpt, lane.runtime.options.dtype,
                                                                        lane.runtime.options.device)]
        new_rows = stage_memory_bytes(gear, self.ckpt, options.dtype, options.device)
        full_kv_tokens = kv_num_blocks(gear) * gear.kv_block_size_tokens
        plan = plan_residency(live_rows, new_rows, options.device_memory_bytes or {}, host_memory_bytes(),
                              full_kv_tokens=full_kv_tokens, block_size_tokens=gear.kv_block_size_tokens,
                              min_kv_tokens=full_kv_tokens, reserve_fraction=self.config.memory_reserve_fraction)
        if plan.mode != "shadow":
            short = [p for p in plan.pools if p["kv_tokens_fit"] is not None and p["kv_tokens_fit"] < full_kv_tokens]
            pool = short[0] if short else plan.pools[0]
            raise InfeasibleError(
                f"gear {gear.gear_id!r} does not fit beside the live instances {[ln.lane_id for ln in live]}: memory "
                f"pool {pool['pool']!r} has {pool['capacity_bytes'] / 2**30:.2f} GiB after the "
                f"{self.config.memory_reserve_fraction:.0%} reserve, they hold {pool['old_bytes'] / 2**30:.2f} GiB and "
                f"it needs {(pool['new_param_bytes'] + pool['new_kv_bytes']) / 2**30:.2f} GiB (weights + "
                f"{full_kv_tokens}-token KV pool); remove an instance or choose a smaller gear or KV pool "
                "(flexpipe serve --kv-capacity-tokens)")

    def remove_instance(self, instance_id: str, drain_timeout_s: float | None = None) -> InstanceRemoval:
        """Stop routing to the instance, let it drain, then shut it down; nothing lost, nothing delivered twice.

        Args:
            instance_id: an id from :meth:`add_instance` or :attr:`instances`.
            drain_timeout_s: how long its in-flight requests may take to finish there (default
                ``config.drain_timeout_s``); after it, the instance is stopped and what it still held is
                re-submitted to the other instances.

        Raises:
            InputError: no such instance, it is not serving, or it is the last live one (add another first).
        """
        t0 = time.monotonic()
        router, ledger = self.router, self.router.ledger
        lane = router.lane(instance_id)
        router.withdraw(lane)
        limit_s = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        deadline = t0 + limit_s
        while lane.alive and ledger.has_open(lane.lane_id) and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_S)
        drain_s = time.monotonic() - t0
        drained = lane.alive and not ledger.has_open(lane.lane_id)
        if drained:
            lane.retire(self.config.release_timeout_s)
        elif lane.alive:  # did not drain in time: stop it; the router moves what it still held
            lane.force_stop()
        return InstanceRemoval(instance_id=lane.lane_id, drained=drained,
                               requests_moved=ledger.num_admitted_to(lane.lane_id) - ledger.num_finished_by(lane.lane_id),
                               drain_s=round(drain_s, 4), total_s=round(time.monotonic() - t0, 4))

    @property
    def instances(self) -> list[InstanceStatus]:
        """The live instances requests are routed to, the entry point first."""
        ledger, entry = self.router.ledger, self.router.active
        return [_status(lane, lane is entry, ledger) for lane in self.router.instances]


def _status(lane: Lane, entry_point: bool, ledger) -> InstanceStatus:
    return InstanceStatus(instance_id=lane.lane_id, gear_id=lane.gear.gear_id, num_stages=lane.gear.num_stages,
                          entry_point=entry_point, longest_request_tokens=lane.runtime.longest_request_tokens,
                          open_requests=ledger.num_open(lane.lane_id), open_work_tokens=ledger.open_tokens(lane.lane_id),
                          requests_admitted=ledger.num_admitted_to(lane.lane_id),
                          requests_finished=ledger.num_finished_by(lane.lane_id))
