"""Dagster resource holding what the planner plans for: model, dtype, and the load it must carry."""

from dagster import ConfigurableResource
from pydantic import Field


class PlanningSettings(ConfigurableResource):
    """Planning inputs (environment: ``FLEXPIPE_MODEL``; the rest are run-config / code settings).

    ``model`` is a built-in name (``SmolLM2-135M``, ``Llama-3-8B``, ...), a Hugging Face
    ``config.json`` directory, or a GGUF file.
    """

    model: str = "SmolLM2-135M"
    dtype: str = "bf16"
    context_p95_tokens: int = Field(default=2048, ge=1, description="P95 context the KV pool is sized for")
    concurrency: int = Field(default=32, ge=1, description="sequences in flight the KV pool must hold")
    min_residence_s: float = Field(default=600.0, ge=0, description="devices leaving sooner are not used")
    reference_trace: str = Field(default="azure-conv",
                                 description="workload gears are scored on (bundled name or path)")
    reference_requests: int = Field(default=1500, ge=50, description="requests of the reference trace to simulate")
    slo_ttft_ms: float = Field(default=2000.0, gt=0)
    slo_tpot_ms: float = Field(default=200.0, gt=0)
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

    def reference_workload_and_context(self):
        """``(workload, report)``: the capped reference trace under the model's context rule (requests
        over the max context left out or truncated, :mod:`flexpipe_dag.workload.context`), and the counts."""
        from flexpipe_dag.workload.context import apply_context_rule

        rule = apply_context_rule(self.capped_reference_trace(), self.max_context_tokens(), self.checked_context_policy())
        return rule.workload, rule.report

    def reference_workload(self):
        """The reference trace with the serving caps and the context rule applied (what gears are scored on)."""
        return self.reference_workload_and_context()[0]

    def plan_workload_and_context(self):
        """``(PlanWorkload, ContextReport)``: planning assumptions from the capped reference trace (mean
        prompt / output, P95 context) with requests over the model's max context left out or truncated
        (:func:`~flexpipe_dag.planner.workload.plan_workload_from_trace`), and how many were.

        Raises:
            InputError: the reference trace or the model cannot be read, or a bad ``context_policy``.
        """
        from flexpipe_dag.planner.workload import plan_workload_from_trace

        return plan_workload_from_trace(self.capped_reference_trace(), max_context_tokens=self.max_context_tokens(),
                                        context_policy=self.checked_context_policy(),
                                        context_p95_cap_tokens=self.context_p95_tokens, concurrency=self.concurrency,
                                        min_residence_s=self.min_residence_s)

    def plan_workload(self):
        """The :class:`~flexpipe_dag.planner.workload.PlanWorkload` of :meth:`plan_workload_and_context`."""
        return self.plan_workload_and_context()[0]
