"""Dagster resource with every figure of the gear-shift controller and of offline (tide) admission.

The resource only names where the figures come from; :meth:`ControlSettings.resolved` reads and
validates them once per process (:func:`flexpipe_dag.control.settings.resolve_control_settings`) into
an immutable :class:`~flexpipe_dag.control.settings.ResolvedControlSettings` that the sensors, the
serve job and the decision services share. The code location resolves them when it loads, so a bad
control file fails the load; a changed file takes effect when the code location is reloaded.
"""

from __future__ import annotations

from functools import lru_cache

from dagster import ConfigurableResource
from pydantic import Field

from flexpipe_dag.control.config import ControllerConfig
from flexpipe_dag.control.settings import (
    ResolvedControlSettings,
    resolve_control_settings,
)
from flexpipe_dag.control.tide import TideConfig


class ControlSettings(ConfigurableResource):
    """Controller and tide settings.

    ``config_file`` (``FLEXPIPE_CONTROL_FILE``) is a YAML file with optional ``controller:`` (any
    field of :class:`~flexpipe_dag.control.config.ControllerConfig`) and ``tide:`` (any field of
    :class:`~flexpipe_dag.control.tide.TideConfig`) sections; unset figures keep the design's seed
    values. ``target_p99_ms`` > 0 sets the service latency target for every gear; ``dwell_s``
    (``FLEXPIPE_DWELL_S``), when set, the minimum dwell after a shift.
    """

    config_file: str = Field(default="", description="YAML with controller: and tide: sections (FLEXPIPE_CONTROL_FILE); "
                             "empty = the design's seed values")
    target_p99_ms: float = Field(default=0.0, ge=0, description="0 = the SLO each gear was planned at")
    dwell_s: float | None = Field(default=None, description="None = the config file's or the seed's 600 s")

    def resolved(self) -> ResolvedControlSettings:
        """The validated figures, read once per process for these three values (then reused as they are).

        Raises:
            InputError: the control file cannot be read, has the wrong shape, or holds a bad figure
                (file and field named).
        """
        return _resolve_once(self.config_file, self.target_p99_ms, self.dwell_s)

    def controller_config(self) -> ControllerConfig:
        """The validated controller config (InputError naming the file and field on a bad value)."""
        return self.resolved().controller

    def tide_config(self) -> TideConfig:
        """The validated tide config (InputError naming the file and field on a bad value)."""
        return self.resolved().tide


@lru_cache(maxsize=32)
def _resolve_once(config_file: str, target_p99_ms: float, dwell_s: float | None) -> ResolvedControlSettings:
    """:func:`resolve_control_settings`, remembered per process: Dagster builds a new resource object for every
    sensor evaluation from the same three values, and the file is not read again for them (an error is not
    remembered: a fixed file reads on the next call)."""
    return resolve_control_settings(config_file, target_p99_ms=target_p99_ms, dwell_s=dwell_s)
