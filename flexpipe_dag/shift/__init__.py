"""Gear shifting on the live runtime: the serving front and the shift executor.

Modules (one job each):

* :mod:`~flexpipe_dag.shift.ledger` - pure, thread-safe request ledger: which pipeline holds each
  request, exactly-once delivery of outputs, the executor's internal probes.
* :mod:`~flexpipe_dag.shift.residency` - pure: can the new gear be resident next to the old one
  (``shadow``), only with a small KV pool (``degraded``), or not at all (``cold``)?
* :mod:`~flexpipe_dag.shift.lane` - one live :class:`~flexpipe_dag.runtime.pipeline.PipelineRuntime`
  and the thread that reads its events.
* :mod:`~flexpipe_dag.shift.router` - :class:`ServingRouter`, the entry point for online and
  offline requests, with an atomic switch of the entry point and re-submission on failure.
* :mod:`~flexpipe_dag.shift.executor` - :class:`GearExecutor`: warm-up, verify, switch, drain,
  health window, release, KV growth, rollback; returns a :class:`ShiftOutcome`.
* :mod:`~flexpipe_dag.shift.instances` - :class:`InstanceFleet`: several instances behind one router,
  added (warm-up, verify, then routed to) and removed (withdrawn, drained, shut down) under load.

The runtime (torch) is imported lazily, inside the functions that start pipelines.
"""

from flexpipe_dag.shift.executor import GearExecutor, ShiftConfig, ShiftOutcome
from flexpipe_dag.shift.instances import InstanceFleet, InstanceRemoval, InstanceStatus
from flexpipe_dag.shift.ledger import INTERNAL_PREFIX, RequestLedger
from flexpipe_dag.shift.residency import ResidencyPlan, plan_residency
from flexpipe_dag.shift.router import ServingRouter

__all__ = ["GearExecutor", "INTERNAL_PREFIX", "InstanceFleet", "InstanceRemoval", "InstanceStatus", "RequestLedger",
           "ResidencyPlan", "ServingRouter", "ShiftConfig", "ShiftOutcome", "plan_residency"]
