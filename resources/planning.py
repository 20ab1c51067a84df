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
    context_p95_tokens: int = Field(2048, ge=1, description="P95 context the KV pool is sized for")
    concurrency: int = Field(32, ge=1, description="sequences in flight the KV pool must hold")
    min_residence_s: float = Field(600.0, ge=0, description="devices leaving sooner are not used")
    reference_trace: str = Field("azure-conv", description="workload gears are scored on (bundled name or path)")
    reference_requests: int = Field(1500, ge=50, description="requests of the reference trace to simulate")
    slo_ttft_ms: float = Field(2000.0, gt=0)
    slo_tpot_ms: float = Field(200.0, gt=0)
