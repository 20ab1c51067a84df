"""Datasheet facts of GPU models seen in real heterogeneous fleets.

The table ships inside the package (``flexpipe_dag/data/gpu_specs.yaml``, copied from the team's
shared data; figures are the vendors' published datasheet numbers, dense, no sparsity). Units are in
the keys: ``memory_gb`` (GiB of device memory), ``hbm_bandwidth_gbps`` (GB/s), ``bf16_tflops`` /
``fp16_tflops`` (TFLOP/s), ``nvlink_gbps`` / ``pcie_gbps`` (GB/s per direction).
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from dataclasses import dataclass

import yaml

#: The reference device for ``compute_score`` 1.0: A100-SXM-80GB, 312 dense bf16 TFLOP/s, 2039 GB/s.
REFERENCE_MODEL = "A100-SXM-80GB"


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model's datasheet figures (units in the field names)."""

    model_name: str
    memory_gib: float
    hbm_bandwidth_gbps: float
    peak_tflops: float
    nvlink_gbps: float | None
    pcie_gbps: float
    bf16: bool

    @property
    def compute_score(self) -> float:
        """Dense half-precision TFLOP/s relative to the A100-SXM-80GB (312 TFLOP/s)."""
        return self.peak_tflops / 312.0


@functools.cache
def gpu_catalog() -> dict[str, GpuSpec]:
    """Return the bundled datasheet table keyed by model name (e.g. ``"T4"``, ``"A100-SXM-80GB"``)."""
    text = importlib.resources.files("flexpipe_dag.data").joinpath("gpu_specs.yaml").read_text()
    raw = yaml.safe_load(text)["gpus"]
    out: dict[str, GpuSpec] = {}
    for name, row in raw.items():
        tflops = row.get("bf16_tflops") or row.get("fp16_tflops")
        out[name] = GpuSpec(
            model_name=name,
            memory_gib=float(row["memory_gb"]),
            hbm_bandwidth_gbps=float(row["hbm_bandwidth_gbps"]),
            peak_tflops=float(tflops),
            nvlink_gbps=float(row["nvlink_gbps"]) if row.get("nvlink_gbps") else None,
            pcie_gbps=float(row["pcie_gbps"]),
            bf16=bool(row.get("bf16", True)),
        )
    return out


def lookup_gpu(name: str | None, memory_gib: float | None = None) -> GpuSpec | None:
    """Find a catalog entry for a model or generation name, or ``None``.

    ``name`` may be an exact key (``"V100-SXM2-16GB"``), a generation (``"V100"``) or an NVML name
    (``"NVIDIA A100-SXM4-80GB"``). Among several matches the one whose memory is closest to
    ``memory_gib`` wins, so ``("V100", 16)`` finds the 16 GB part.
    """
    if not name:
        return None
    catalog = gpu_catalog()
    if name in catalog:
        return catalog[name]
    needle = _tokens(name.upper().replace("NVIDIA", "").replace("TESLA", ""))
    matches = [spec for key, spec in catalog.items() if _contains(needle, _family(key))]
    if not matches:
        return None
    if memory_gib is None:
        return matches[0]
    return min(matches, key=lambda s: abs(s.memory_gib - memory_gib))


def _tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[\s\-_]+", text.upper()) if t]


def _family(key: str) -> list[str]:
    """Tokens of a catalog key without form factor and memory (``V100-SXM2-16GB`` -> ``[V100]``)."""
    return [t for t in _tokens(key) if not re.fullmatch(r"SXM\d*|PCIE|\d+GB", t)]


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))
