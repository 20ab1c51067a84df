"""The control settings, resolved once: the controller's and the tide's figures in one immutable object.

A control file (``FLEXPIPE_CONTROL_FILE`` in the Dagster code location) is a YAML file with optional
``controller:`` (any field of :class:`~flexpipe_dag.control.config.ControllerConfig`) and ``tide:``
(any field of :class:`~flexpipe_dag.control.tide.TideConfig`) sections; unset figures keep the
design's seed values. :func:`resolve_control_settings` reads and validates it (plus the two
overrides, the latency target and the dwell) into a :class:`ResolvedControlSettings`, which the
decision services (:mod:`flexpipe_dag.control.service`) and the serve loop take as it is: nothing
re-reads the file afterwards.

Plain Python and pydantic: no Dagster and no store here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from flexpipe_dag.control.config import ControllerConfig
from flexpipe_dag.control.tide import TideConfig, load_history
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.user_files import MAX_YAML_BYTES, read_user_text
from flexpipe_dag.core.user_yaml import load_user_yaml

#: The sections a control file may hold.
CONTROL_SECTIONS = ("controller", "tide")

_Model = TypeVar("_Model", bound=BaseModel)


@dataclass(frozen=True)
class ResolvedControlSettings:
    """The controller's and the tide's validated figures (both pydantic models are frozen too).

    ``source`` is the control file they were read from ("" = the seeds and overrides only), for
    messages.
    """

    controller: ControllerConfig = field(default_factory=ControllerConfig)
    tide: TideConfig = field(default_factory=TideConfig)
    source: str = ""


def read_control_file(config_file: str) -> dict[str, dict[str, Any]]:
    """The ``controller`` / ``tide`` sections of a control file (``{}`` for ``config_file`` "").

    Returns:
        ``{section: {figure: value}}`` with only the sections the file holds (a section left
        empty in the YAML reads as ``{}``); the figures are not validated here.

    Raises:
        InputError: the file cannot be read ("cannot read controller config": missing, not a regular file, holds more than
            :data:`~flexpipe_dag.core.user_files.MAX_YAML_BYTES`, not UTF-8), or is not YAML (a
            duplicate key or an alias counts as not YAML: :func:`~flexpipe_dag.core.user_yaml.load_user_yaml`), is not
            a mapping of those sections, or a section is not a mapping of figures (file and
            section named).
    """
    if not config_file:
        return {}
    path = Path(config_file)
    try:
        text = read_user_text(path, MAX_YAML_BYTES, what="controller config (YAML)")
    except InputError as exc:
        raise InputError(str(path), None, f"cannot read controller config: {exc.problem}") from None
    data = load_user_yaml(text, str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict) or set(data) - set(CONTROL_SECTIONS):
        raise InputError(str(path), None, "expected a mapping with 'controller' and/or 'tide' sections")
    for section, values in data.items():
        if values is not None and not isinstance(values, dict):
            raise InputError(str(path), section, f"expected a mapping of figures, got a {type(values).__name__}")
    return {section: dict(values or {}) for section, values in data.items()}


def resolve_control_settings(config_file: str = "", *, target_p99_ms: float = 0.0,
                             dwell_s: float | None = None) -> ResolvedControlSettings:
    """Read and validate the control settings once.

    Args:
        config_file: the YAML control file ("" = the seed figures).
        target_p99_ms: > 0 sets the service latency target (milliseconds) for every gear, over the
            file's ``controller.target_p99_ms``; 0 keeps the file's (or the SLO each gear was planned at).
        dwell_s: the minimum dwell after a shift (seconds), over the file's ``controller.dwell_s``;
            None keeps the file's (or the seed's 600 s).

    Raises:
        InputError: the file cannot be read or has the wrong shape (:func:`read_control_file`), or a
            figure is out of range: the file (or "control settings" without one) and the field
            (``controller.ema_alpha``, ``tide.horizon_s``) are named, and every other bad figure of
            the same section follows as "; also <field>: <why>"; ``tide.history_file`` is missing or not a
            tide (read here, its bad row named).
    """
    sections = read_control_file(config_file)
    values = dict(sections.get("controller") or {})
    if target_p99_ms > 0:
        values["target_p99_ms"] = target_p99_ms
    if dwell_s is not None:
        values["dwell_s"] = dwell_s
    controller = validated(ControllerConfig, values, config_file, "controller")
    tide = validated(TideConfig, dict(sections.get("tide") or {}), config_file, "tide")
    if tide.history_file:  # read now: a bad history would only fail at the first forecast, which is then skipped
        try:
            load_history(tide)
        except InputError as exc:
            raise InputError(config_file or "control settings", "tide.history_file", str(exc)) from None
    return ResolvedControlSettings(controller=controller, tide=tide, source=config_file)


def validated(model: type[_Model], values: dict[str, Any], source: str, section: str) -> _Model:
    """``model.model_validate(values)``, a validation error turned into one :class:`InputError`.

    Raises:
        InputError: ``source`` (or "control settings" when "") and ``<section>.<field>`` of the first
            bad figure named, the others appended as "; also <section>.<field>: <why>".
    """
    from pydantic import ValidationError

    try:
        return model.model_validate(values)
    except ValidationError as err:
        errors = err.errors()
        where = [".".join(str(p) for p in (section, *e["loc"])) for e in errors]
        more = "".join(f"; also {w}: {e['msg']}" for w, e in zip(where[1:], errors[1:]))
        raise InputError(source or "control settings", where[0], errors[0]["msg"].removeprefix("Value error, ") + more) from None
