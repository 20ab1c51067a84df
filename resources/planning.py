"""Dagster resource holding what the planner plans for: model, dtype, SLO and the load it must carry.

``flexpipe plan`` builds the same resource (:func:`planning_from_env` plus its flags) and calls the
same :meth:`PlanningSettings.plan`, so the CLI and the ``candidate_gears`` asset plan with one code
path and one set of defaults (:mod:`flexpipe_dag.planner.operating`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal, get_args, get_origin

from dagster import ConfigurableResource
from pydantic import Field

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.settings import INT32_MAX, env_value
from flexpipe_dag.planner.operating import (
    DEFAULT_ATTAINMENT,
    DEFAULT_CONCURRENCY,
    DEFAULT_MIN_RESIDENCE_S,
    DEFAULT_REFERENCE_REQUESTS,
    DEFAULT_REFERENCE_TRACE,
    DEFAULT_SLO_TPOT_MS,
    DEFAULT_SLO_TTFT_MS,
    MAX_SLO_MS,
)


class PlanningSettings(ConfigurableResource):
    """Planning inputs (environment: :data:`PLANNING_ENV`; the rest are run-config / code settings).

    ``model`` is a built-in name (``SmolLM2-135M``, ``Llama-3-8B``, ...), a Hugging Face
    ``config.json`` directory, or a GGUF file. Every envelope is measured against ``slo_ttft_ms`` /
    ``slo_tpot_ms`` at ``attainment`` on ``reference_trace``.
    """

    model: str = Field(default="SmolLM2-135M", description="model planned for: a built-in name, a Hugging Face "
                       "config.json directory or a GGUF file")
    dtype: str = Field(default="bf16", description="dtype the gears compute in (fp32, fp16, bf16, ...)")
    context_p95_tokens: int | None = Field(default=None, ge=1, description="P95 context the KV pool is sized for: "
                                           "the reference trace's, at most this when set")
    concurrency: int = Field(default=DEFAULT_CONCURRENCY, ge=1, description="sequences in flight the KV pool must hold")
    min_residence_s: float = Field(default=DEFAULT_MIN_RESIDENCE_S, ge=0, description="devices leaving sooner are not used")
    reference_trace: str = Field(default=DEFAULT_REFERENCE_TRACE,
                                 description="workload gears are scored on (bundled name or path)")
    reference_requests: int = Field(default=DEFAULT_REFERENCE_REQUESTS, ge=50,
                                    description="requests of the reference trace replayed per envelope probe")
    slo_ttft_ms: float = Field(default=DEFAULT_SLO_TTFT_MS, gt=0, le=MAX_SLO_MS, description="TTFT SLO envelopes are measured at, ms")
    slo_tpot_ms: float = Field(default=DEFAULT_SLO_TPOT_MS, gt=0, le=MAX_SLO_MS, description="TPOT SLO envelopes are measured at, ms")
    attainment: float = Field(default=DEFAULT_ATTAINMENT, gt=0, le=1,
                              description="share of requests that must meet the SLO for a rate to count as served")
    load_rps: float | None = Field(default=None, ge=0, description="expected load: the gear for it is marked recommended")
    objective: Literal["speed", "devices"] = Field(default="speed", description="how the operating gears are chosen")
    bf16_fallback: Literal["fp16", "exclude", "refuse"] = Field(
        default="fp16", description="bf16 requested on devices without it (V100, T4): run the gear in fp16, "
                                    "leave those devices out, or refuse")
    max_prompt_tokens: int = Field(default=0, ge=0, description="cap on prompt tokens served (0 = none; CPU demos cap)")
    max_new_tokens: int = Field(default=0, ge=0, description="cap on generated tokens (0 = none)")
    context_policy: str = Field(default="refuse",
                                description="reference requests over the model's max context (prompt + output "
                                            "tokens): 'refuse' leaves them out, 'truncate' cuts their prompts")
    stage_replicas: bool = Field(default=True,
                                 description="allow replicas of a hot stage (the runtime runs one worker per replica)")
    replan_margin: float = Field(default=0.10, gt=0, description="a calibration that moves a gear's estimate by more "
                                                                 "than this fraction re-plans the gears")

    def capped_reference_trace(self):
        """The reference trace with the serving caps (``max_prompt_tokens``, ``max_new_tokens``) applied."""
        import dataclasses

        from flexpipe_dag.workload.bundled import load_trace

        trace = load_trace(self.reference_trace)
        if not (self.max_prompt_tokens or self.max_new_tokens):
            return trace
        cap_in = self.max_prompt_tokens or None
        cap_out = self.max_new_tokens or None
        return dataclasses.replace(trace, requests=tuple(
            dataclasses.replace(r, input_tokens=min(r.input_tokens, cap_in or r.input_tokens),
                                output_tokens=min(r.output_tokens, cap_out or r.output_tokens))
            for r in trace.requests))

    def max_context_tokens(self) -> int | None:
        """The model's max context (prompt + output tokens), ``None`` when its description does not say."""
        from flexpipe_dag.planner.model_spec import load_model_spec

        return load_model_spec(self.model).max_context_tokens

    def checked_context_policy(self):
        """``context_policy`` checked ('refuse' or 'truncate').

        Raises:
            InputError: another value, naming the setting.
        """
        from flexpipe_dag.workload.context import check_context_policy

        return check_context_policy(self.context_policy, "PlanningSettings", "context_policy")

    def reference_workload_and_context(self, trace=None):
        """``(workload, report)``: the capped reference trace (``trace``, when already loaded) under the
        model's context rule (requests over the max context left out or truncated,
        :mod:`flexpipe_dag.workload.context`), and the counts."""
        from flexpipe_dag.workload.context import apply_context_rule

        rule = apply_context_rule(self.capped_reference_trace() if trace is None else trace, self.max_context_tokens(),
                                  self.checked_context_policy())
        return rule.workload, rule.report

    def reference_workload(self):
        """The reference trace with the serving caps and the context rule applied (what gears are scored on)."""
        return self.reference_workload_and_context()[0]

    def plan_workload_and_context(self, trace=None):
        """``(PlanWorkload, ContextReport)``: planning assumptions (mean prompt / output, P95 context) from
        the capped reference trace (``trace``, when already loaded) with requests over the model's max
        context left out or truncated (:func:`~flexpipe_dag.planner.workload.plan_workload_from_trace`),
        and how many were.

        Raises:
            InputError: the reference trace or the model cannot be read, or a bad ``context_policy``.
        """
        import dataclasses

        from flexpipe_dag.planner.workload import plan_workload_from_trace

        workload, report = plan_workload_from_trace(
            self.capped_reference_trace() if trace is None else trace, max_context_tokens=self.max_context_tokens(),
            context_policy=self.checked_context_policy(), context_p95_cap_tokens=self.context_p95_tokens,
            concurrency=self.concurrency, min_residence_s=self.min_residence_s)
        return dataclasses.replace(workload, bf16_fallback=self.bf16_fallback, slo_ttft_ms=self.slo_ttft_ms,
                                   slo_tpot_ms=self.slo_tpot_ms, slo_attainment=min(max(self.attainment, 0.5), 0.999)), report

    def plan_workload(self):
        """The :class:`~flexpipe_dag.planner.workload.PlanWorkload` of :meth:`plan_workload_and_context`."""
        return self.plan_workload_and_context()[0]

    def selection_settings(self):
        """The SLO, attainment and probe size envelopes are measured with."""
        from flexpipe_dag.planner.envelope import SelectionSettings

        return SelectionSettings(slo_ttft_ms=self.slo_ttft_ms, slo_tpot_ms=self.slo_tpot_ms,
                                 attainment=self.attainment, num_requests=self.reference_requests)

    def plan(self, cluster, model, *, profile_version: int | None = None, device_overrides=None,
             progress: Callable[[str], None] | None = None):
        """The operating gears of ``model`` (a ModelSpec) on ``cluster``, envelopes measured in the simulator.

        Returns:
            :class:`~flexpipe_dag.planner.operating.OperatingPlan`.

        Raises:
            InfeasibleError: the model cannot be placed. InputError: a bad setting (named).
        """
        from flexpipe_dag.planner.operating import plan_operating_gears

        trace = self.capped_reference_trace()  # read once; both views below apply the same context rule
        reference, report = self.reference_workload_and_context(trace)
        workload, _ = self.plan_workload_and_context(trace)
        return plan_operating_gears(cluster, model, reference, workload=workload, context_report=report,
                                    dtype=self.dtype, settings=self.selection_settings(), objective=self.objective,
                                    load_rps=self.load_rps, profile_version=profile_version,
                                    device_overrides=device_overrides, replicas=self.stage_replicas, progress=progress)


#: Environment variables that set PlanningSettings fields (unset: the field's default).
PLANNING_ENV = {"FLEXPIPE_MODEL": "model", "FLEXPIPE_PLAN_DTYPE": "dtype", "FLEXPIPE_SLO_TTFT_MS": "slo_ttft_ms",
                "FLEXPIPE_SLO_TPOT_MS": "slo_tpot_ms", "FLEXPIPE_SLO_ATTAINMENT": "attainment",
                "FLEXPIPE_MAX_PROMPT_TOKENS": "max_prompt_tokens",
                "FLEXPIPE_MAX_NEW_TOKENS": "max_new_tokens", "FLEXPIPE_PLAN_CONCURRENCY": "concurrency",
                "FLEXPIPE_REFERENCE_REQUESTS": "reference_requests", "FLEXPIPE_STAGE_REPLICAS": "stage_replicas",
                "FLEXPIPE_BF16_FALLBACK": "bf16_fallback", "FLEXPIPE_PLAN_OBJECTIVE": "objective"}

#: The field types :func:`planning_from_env` parses with ``env_value`` (others are taken as stripped strings).
_SCALAR_KINDS: dict[object, type[int | float | bool]] = {int: int, float: float, bool: bool}


def _unit_of(name: str) -> str:
    """Unit named by a field's suffix, for error messages."""
    for suffix, unit in (("_ms", "milliseconds"), ("_s", "seconds"), ("_tokens", "tokens")):
        if name.endswith(suffix):
            return unit
    return ""


def _bounds_of(field) -> dict:
    """``ge`` / ``gt`` / ``le`` / ``lt`` of a pydantic field's ``Field(...)`` constraints."""
    out = {}
    for constraint in field.metadata:
        for key in ("ge", "gt", "le", "lt"):
            value = getattr(constraint, key, None)
            if value is not None:
                out[key] = value
    return out


def planning_from_env() -> dict[str, Any]:
    """PlanningSettings fields set by :data:`PLANNING_ENV` variables, each parsed and range-checked.

    Raises:
        InputError: a variable is not of its field's type (int / float / bool) or is outside the
            field's range (named: variable, expected type and range, value given); an unknown dtype.
    """
    from flexpipe_dag.core.dtypes import canonical_dtype

    fields = PlanningSettings.model_fields
    out: dict[str, object] = {}
    for var, name in PLANNING_ENV.items():
        kind = _SCALAR_KINDS.get(fields[name].annotation)
        value: object
        if kind is not None:
            bounds = _bounds_of(fields[name])
            if kind is int:
                bounds.setdefault("le", INT32_MAX)
            value = env_value(var, kind, None, unit=_unit_of(name), **bounds)
        else:
            value = (os.environ.get(var) or "").strip() or None
        if value is not None:
            out[name] = value
    for var, name in PLANNING_ENV.items():
        allowed = get_args(fields[name].annotation) if get_origin(fields[name].annotation) is Literal else ()
        if name in out and allowed and out[name] not in allowed:
            raise InputError(f"environment variable {var}", None,
                             f"expected one of {', '.join(allowed)}, got {out[name]!r}")
    if "dtype" in out:
        out["dtype"] = canonical_dtype(str(out["dtype"]), "environment variable FLEXPIPE_PLAN_DTYPE", None)
    return out


def settings_from_env(overrides: dict[str, Any], names: dict[str, str] | None = None) -> PlanningSettings:
    """The planning resource the environment (:func:`planning_from_env`) sets, with ``overrides`` on top:
    what ``flexpipe plan`` and ``flexpipe simulate --gear KIND`` plan with, as the Dagster code location does.

    Args:
        overrides: field -> value (``None`` values are ignored: the environment or the default stands).
        names: field -> the name the user gave it (a CLI flag), for error messages.

    Raises:
        InputError: a bad environment variable, or a value outside its field's range (named).
    """
    from pydantic import ValidationError

    values = planning_from_env()
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return PlanningSettings(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err.get("loc") else None
        raise InputError(None, (names or {}).get(field or "", field), f"{err['msg']}, got {err.get('input')!r}") from None
