"""The controller's state and its decisions: plain, JSON-serialisable pydantic models.

:class:`ControllerState` is everything the controller remembers between calls, so a Dagster sensor
cursor (a string) can hold it: ``state.to_cursor()`` writes it, ``ControllerState.from_cursor(s)``
reads back exactly what was written (floats are written in shortest round-trip form).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flexpipe_dag.core.errors import InputError

#: Trigger names, in the order the controller acts on them when several fire at once.
TriggerName = Literal["current_unhealthy", "rps_above_envelope", "forecast_above_envelope", "latency_over",
                      "imbalance", "rps_below_envelope", "latency_under", "fewer_devices_hold"]
TRIGGER_PRIORITY: tuple[TriggerName, ...] = ("current_unhealthy", "rps_above_envelope", "forecast_above_envelope",
                                             "latency_over", "imbalance", "rps_below_envelope", "latency_under",
                                             "fewer_devices_hold")

#: Shifts the controller chooses to make, not ones the load forces: they are charged for devices
#: (``device_weight``) and may not leave the load of the recent past without a gear that holds it.
DISCRETIONARY_TRIGGERS: frozenset[str] = frozenset({"imbalance", "latency_under", "rps_below_envelope",
                                                    "fewer_devices_hold"})

#: 2 added the forecast, recent peaks and the last discretionary shift; a version-1 cursor reads as
#: a version-2 state with those empty. 3 names the request rate ``rps`` (``ema_rps``, ``forecast_rps``,
#: ``rps_peaks``, triggers ``rps_above_envelope`` / ``rps_below_envelope``); older cursors spelled it
#: ``qps`` and are read with those names mapped.
STATE_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
_LEGACY_NAMES = {"ema_qps": "ema_rps", "forecast_qps": "forecast_rps", "qps_peaks": "rps_peaks",
                 "qps_above_envelope": "rps_above_envelope", "qps_below_envelope": "rps_below_envelope"}


def _upgrade_legacy(doc: dict[str, Any]) -> dict[str, Any]:
    """A version-1/2 cursor document with its ``qps`` names mapped to the ``rps`` ones."""
    doc = {_LEGACY_NAMES.get(k, k): v for k, v in doc.items() if _LEGACY_NAMES.get(k) not in doc}  # new name wins
    if isinstance(doc.get("counts"), dict):
        counts = doc["counts"]
        doc["counts"] = {_LEGACY_NAMES.get(k, k): v for k, v in counts.items() if _LEGACY_NAMES.get(k) not in counts}
    if isinstance(doc.get("escalated"), list):
        doc["escalated"] = [_LEGACY_NAMES.get(k, k) for k in doc["escalated"]]
    return doc


class ControllerState(BaseModel):
    """What the controller remembers between calls (all plain JSON types).

    Times (``*_s``) are on the samples' clock (``MetricSample.t_s``). ``ema_*`` are exponential
    moving averages over the samples of the serving gear (``ema_rps``, ``ema_queue_length`` and
    ``ema_running`` and ``ema_completed_rps`` carry over a shift: the load does not change with the gear; latency and stage
    utilisation restart). ``counts[trigger]`` is the number of consecutive samples its condition has
    held. ``escalated`` lists the triggers whose current episode already raised the threshold
    inside a dwell (see :mod:`flexpipe_dag.control.config`).
    """

    model_config = ConfigDict(extra="forbid")

    version: int = STATE_VERSION
    gear_id: str | None = Field(None, description="gear serving in the newest sample")
    gear_since_s: float | None = Field(
        None, description="when a shift to that gear was first seen in the samples (None for the gear "
                          "serving when the controller started: its start is unknown)")
    samples_seen: int = 0
    last_sample_t_s: float | None = Field(None, description="newest sample consumed; older ones are skipped")
    ema_rps: float | None = None
    ema_queue_length: float | None = None
    ema_running: float | None = None
    ema_completed_rps: float | None = None
    ema_p99_ms: float | None = None
    forecast_rps: float | None = Field(
        None, description="highest request rate the caller's forecast expected within forecast_horizon_s, at the newest "
                          "sample (None without a forecast)", ge=0.0, allow_inf_nan=False)
    forecast_error: str | None = Field(None, description="why the forecast was ignored at the newest sample")
    ema_stage_busy: list[float] = Field(default_factory=list)
    rps_peaks: list[tuple[float, float]] = Field(
        default_factory=list, description="(bucket start s, highest smoothed request rate in it) over the last "
                                          "recent_peak_window_s, ten buckets; carries over a shift")
    counts: dict[str, int] = Field(default_factory=dict)
    escalated: list[str] = Field(default_factory=list)
    escalation_steps: int = 0
    last_escalation_s: float | None = None
    last_shift_s: float | None = None
    last_discretionary_shift: tuple[str, str, float] | None = Field(
        None, description="(from gear, to gear, t_s) of the newest shift a discretionary trigger asked for")
    pending_to_gear_id: str | None = None
    pending_since_s: float | None = None
    residence_ema_s: float | None = None
    shifts: int = 0

    def to_cursor(self) -> str:
        """Compact JSON string for a sensor cursor."""
        return self.model_dump_json()

    @classmethod
    def from_cursor(cls, cursor: str | None) -> ControllerState:
        """Read a cursor written by :meth:`to_cursor`; ``None`` or ``""`` gives a fresh state.

        Raises:
            InputError: the cursor is not a controller state of a version this code reads.
        """
        if not cursor:
            return cls()
        try:
            doc = json.loads(cursor)
            version = doc.get("version")
        except (ValueError, AttributeError):
            doc, version = None, None
        if version is not None and version not in READABLE_VERSIONS:
            raise InputError("sensor cursor", "version", f"written by controller state version {version!r}; this "
                                                         f"FlexPipe reads versions {list(READABLE_VERSIONS)}")
        try:
            if isinstance(doc, dict) and version in (1, 2):
                state = cls.model_validate(_upgrade_legacy(doc))
            else:
                state = cls.model_validate_json(cursor)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or None
            raise InputError("sensor cursor", field, f"not a controller state: {first['msg']}") from None
        return state.model_copy(update={"version": STATE_VERSION})


#: What kind of decision a reason explains (README, "How to read a decision"): a hold with nothing to do
#: (``no_samples``, ``no_trigger``), a trigger still counting its samples (``counting``), a shift under way
#: (``in_progress``), a shift (``shift``), or a decline: inside the dwell (``dwell``), the shift does not pay
#: back (``payback``), no healthy gear's envelope holds the load (``no_gear_holds``), or gears hold it
#: but the trigger's rules leave none to move to (``no_candidate``). The decision service adds two holds of
#: its own: the serving pipeline is not live (``not_live``: its run ended, is a batch job, or its samples or
#: heartbeat are older than ``sample_freshness_s``) and a backlog still being read (``backlog``).
ReasonKind = Literal["no_samples", "no_trigger", "counting", "in_progress", "shift", "dwell", "payback",
                     "no_gear_holds", "no_candidate", "not_live", "backlog", "instances"]
DECLINE_KINDS: tuple[ReasonKind, ...] = ("dwell", "payback", "no_gear_holds", "no_candidate")


class Decision(BaseModel):
    """One controller decision, taken or declined, with the reason an operator reads.

    ``action`` is ``"shift"`` only when the controller asks for a shift now. A declined shift is a
    ``"hold"`` with ``declined=True``, the trigger, the target it considered (if any) and why not.
    ``estimated_gain_fraction`` is the goodput-equivalent fraction of full service the target is
    expected to add (see :mod:`flexpipe_dag.control.payback`); gain x ``expected_residence_s`` is
    compared with ``migration_cost_s``. ``reason_kind`` names the kind of reason (:data:`ReasonKind`;
    None only on decisions stored before it existed).
    """

    model_config = ConfigDict(extra="forbid")

    t_s: float
    action: Literal["hold", "shift"]
    from_gear_id: str | None
    to_gear_id: str | None = None
    trigger: TriggerName | None = None
    reason: str
    declined: bool = False
    required_samples: int
    estimated_gain_fraction: float | None = None
    migration_cost_s: float | None = None
    expected_residence_s: float | None = None
    reason_kind: ReasonKind | None = None
