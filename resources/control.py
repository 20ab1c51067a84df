"""Dagster resource with every figure of the gear-shift controller and of offline (tide) admission."""

from pathlib import Path

import yaml
from dagster import ConfigurableResource
from pydantic import Field

from flexpipe_dag.control.config import ControllerConfig
from flexpipe_dag.control.tide import TideConfig
from flexpipe_dag.core.errors import InputError


class ControlSettings(ConfigurableResource):
    """Controller and tide settings.

    ``config_file`` (``FLEXPIPE_CONTROL_FILE``) is a YAML file with optional ``controller:`` (any
    field of :class:`~flexpipe_dag.control.config.ControllerConfig`) and ``tide:`` (any field of
    :class:`~flexpipe_dag.control.tide.TideConfig`) sections; unset figures keep the design's seed
    values. ``target_p99_ms`` > 0 sets the service latency target for every gear.
    """

    config_file: str = ""
    target_p99_ms: float = Field(0.0, ge=0, description="0 = each gear's own target")
    dwell_s: float = Field(-1.0, description="< 0 = the config file's or the seed's 600 s")

    def _sections(self) -> dict:
        if not self.config_file:
            return {}
        path = Path(self.config_file)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise InputError(str(path), None, f"cannot read controller config: {str(exc).splitlines()[0]}") from None
        if not isinstance(data, dict) or set(data) - {"controller", "tide"}:
            raise InputError(str(path), None, "expected a mapping with 'controller' and/or 'tide' sections")
        for section, values in data.items():
            if values is not None and not isinstance(values, dict):
                raise InputError(str(path), section, f"expected a mapping of figures, got {values!r}")
        return data

    def controller_config(self) -> ControllerConfig:
        """The validated controller config (InputError naming the file and field on a bad value)."""
        values = dict(self._sections().get("controller") or {})
        if self.target_p99_ms > 0:
            values["target_p99_ms"] = self.target_p99_ms
        if self.dwell_s >= 0:
            values["dwell_s"] = self.dwell_s
        return _validated(ControllerConfig, values, self.config_file, "controller")

    def tide_config(self) -> TideConfig:
        return _validated(TideConfig, dict(self._sections().get("tide") or {}), self.config_file, "tide")


def _validated(model, values: dict, source: str, section: str):
    from pydantic import ValidationError

    try:
        return model.model_validate(values)
    except ValidationError as err:
        errors = err.errors()
        where = [".".join(str(p) for p in (section, *e["loc"])) for e in errors]
        more = "".join(f"; also {w}: {e['msg']}" for w, e in zip(where[1:], errors[1:]))
        raise InputError(source or "control settings", where[0], errors[0]["msg"] + more) from None
