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
    stage_replicas: bool = Field(default=True,
                                 description="allow replicas of a hot stage (the runtime runs one worker per replica)")
    replan_margin: float = Field(default=0.10, gt=0, description="a calibration that moves a gear's estimate by more "
                                                                 "than this fraction re-plans the gears")

    def reference_workload(self):
        """The reference trace with the serving caps applied to its lengths (what gears are scored on)."""
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

    def plan_workload(self):
        """Planning assumptions from the reference trace: mean prompt / output and P95 context after the caps.

        Raises:
            InputError: the reference trace cannot be read.
        """
        import numpy as np

        from flexpipe_dag.planner.workload import PlanWorkload

        frame = self.reference_workload().to_frame()
        prompt = frame["input_tokens"].to_numpy()
        output = frame["output_tokens"].to_numpy()
        return PlanWorkload(context_p95_tokens=min(self.context_p95_tokens, int(np.percentile(prompt + output, 95))),
                            concurrency=self.concurrency, prompt_tokens_mean=max(1, int(prompt.mean())),
                            output_tokens_mean=max(1, int(output.mean())), min_residence_s=self.min_residence_s)
