"""Gear-shift control: a pure controller (EMA, hysteresis, dwell, payback) and migration-cost estimates.

Plain data in, plain data out; no Dagster, SQL or torch. The same :class:`Controller` reads metric
samples from the simulator and from the live runtime. :mod:`~flexpipe_dag.control.settings` resolves
the control file once; :mod:`~flexpipe_dag.control.service` holds the decision services the sensors and
the serve loop call (the store reached through a protocol).
"""

from flexpipe_dag.control.config import ControllerConfig
from flexpipe_dag.control.controller import Controller
from flexpipe_dag.control.migration import (
    LayerMove,
    bytes_to_move,
    drain_time_s,
    layer_moves,
    migration_cost_fn,
    migration_cost_s,
    weight_transfer_s,
)
from flexpipe_dag.control.state import TRIGGER_PRIORITY, ControllerState, Decision

__all__ = [
    "TRIGGER_PRIORITY", "Controller", "ControllerConfig", "ControllerState", "Decision", "LayerMove",
    "bytes_to_move", "drain_time_s", "layer_moves", "migration_cost_fn", "migration_cost_s", "weight_transfer_s",
]
