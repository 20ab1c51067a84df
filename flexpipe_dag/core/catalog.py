"""Datasheet facts of GPU models seen in real heterogeneous fleets.

The table ships inside the package (``flexpipe_dag/data/gpu_specs.yaml``; its first rows copied from
the team's shared data, every row naming its vendor datasheet in ``source``; figures are dense, no
sparsity). Units are in the keys: ``memory_gb`` (the datasheet's label, e.g. "16 GB"),
``memory_visible_mib`` (the total the driver reports, nvidia-smi / NVML, MiB), ``hbm_bandwidth_gbps``
(GB/s), ``bf16_tflops`` / ``fp16_tflops`` (TFLOP/s), ``nvlink_gbps`` / ``pcie_gbps`` (GB/s per direction).

Memory: :attr:`GpuSpec.memory_gib` is the **driver-visible** total in GiB (2^30 bytes), not the
label: a T4 sold as "16 GB" reports 15360 MiB = 15.0 GiB (ECC takes 6.25 % of GDDR memory). Where the
table has no reported figure it is derived from the label by :func:`visible_gib_from_label` and
:attr:`GpuSpec.memory_visible_source` says so.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from dataclasses import dataclass

import yaml

#: The reference device for ``compute_score`` 1.0: A100-SXM-80GB, 312 dense bf16 TFLOP/s, 2039 GB/s.
REFERENCE_MODEL = "A100-SXM-80GB"
#: Share of a GPU's labelled memory its driver shows when no reported figure is known: GDDR memory
#: with ECC on loses 6.25 % to ECC bits (NVIDIA CUDA C++ Best Practices Guide, "Device Memory Spaces":
#: "On GPUs with GDDR memory with ECC enabled the available DRAM is reduced by 6.25%"); HBM parts lose
#: less, so the figure is on the safe side for them.
GDDR_ECC_VISIBLE_FRACTION = 0.9375
#: Share of an HBM GPU's labelled memory its driver shows when no reported figure is known: the
#: H100-SXM-80GB's 81559 MiB of 81920 (ECC on HBM does not take DRAM capacity).
HBM_VISIBLE_FRACTION = 81559 / 81920
#: Lowest compute capability with bfloat16 tensor math (Ampere); vLLM refuses bf16 below it.
BF16_MIN_COMPUTE_CAPABILITY = 8.0


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model's datasheet figures (units in the field names).

    ``memory_gib`` is the driver-visible total (GiB), ``memory_label_gb`` the datasheet label (GB as
    printed). ``bf16``: whether the device has bfloat16 tensor math.
    """

    model_name: str
    memory_gib: float
    hbm_bandwidth_gbps: float
    peak_tflops: float
    nvlink_gbps: float | None
    pcie_gbps: float
    bf16: bool
    memory_label_gb: float = 0.0
    compute_capability: float | None = None
    memory_visible_source: str = ""
    source: str = ""

    @property
    def compute_score(self) -> float:
        """Dense half-precision TFLOP/s relative to the A100-SXM-80GB (312 TFLOP/s)."""
        return self.peak_tflops / 312.0

    @property
    def generation(self) -> str:
        """The family name without form factor and memory (``"V100-SXM2-16GB"`` -> ``"V100"``)."""
        return "-".join(_family(self.model_name)) or self.model_name


def visible_gib_from_label(memory_label_gb: float, hbm: bool = False) -> float:
    """Driver-visible GiB to assume for a GPU labelled ``memory_label_gb`` whose reported total is unknown.

    The label's "GB" of GPU memory is binary (a "16 GB" T4 carries 16 GiB of DRAM); the driver shows
    ``label x`` :data:`HBM_VISIBLE_FRACTION` of it on an HBM part and ``label x``
    :data:`GDDR_ECC_VISIBLE_FRACTION` on a GDDR part with ECC on (the default: the safe side).
    """
    return memory_label_gb * (HBM_VISIBLE_FRACTION if hbm else GDDR_ECC_VISIBLE_FRACTION)


@functools.cache
def gpu_catalog() -> dict[str, GpuSpec]:
    """Return the bundled datasheet table keyed by model name (e.g. ``"T4"``, ``"A100-SXM-80GB"``)."""
    text = importlib.resources.files("flexpipe_dag.data").joinpath("gpu_specs.yaml").read_text()
    raw = yaml.safe_load(text)["gpus"]
    out: dict[str, GpuSpec] = {}
    for name, row in raw.items():
        tflops = row.get("bf16_tflops") or row.get("fp16_tflops")
        label = float(row["memory_gb"])
        if row.get("memory_visible_mib"):
            visible = float(row["memory_visible_mib"]) / 1024.0
            visible_source = str(row.get("visible_source", ""))
        else:
            hbm = str(row.get("memory_type", "GDDR")).upper() == "HBM"
            visible = visible_gib_from_label(label, hbm)
            visible_source = (f"derived: label {label:g} GB x "
                              f"{HBM_VISIBLE_FRACTION if hbm else GDDR_ECC_VISIBLE_FRACTION:.4f} (no reported total known)")
        cc = float(row["compute_capability"]) if row.get("compute_capability") is not None else None
        default_bf16 = cc is None or cc >= BF16_MIN_COMPUTE_CAPABILITY
        out[name] = GpuSpec(
            model_name=name,
            memory_gib=visible,
            hbm_bandwidth_gbps=float(row["hbm_bandwidth_gbps"]),
            peak_tflops=float(tflops),
            nvlink_gbps=float(row["nvlink_gbps"]) if row.get("nvlink_gbps") else None,
            pcie_gbps=float(row["pcie_gbps"]),
            bf16=bool(row.get("bf16", default_bf16)),
            memory_label_gb=label,
            compute_capability=cc,
            memory_visible_source=visible_source,
            source=str(row.get("source", "")),
        )
    return out


def known_generations() -> list[str]:
    """Family names the catalog knows (``A100``, ``T4``, ``V100``, ...), sorted, for error messages."""
    return sorted({spec.generation for spec in gpu_catalog().values()})


def lookup_gpu(name: str | None, memory_gib: float | None = None) -> GpuSpec | None:
    """Find a catalog entry for a model or generation name, or ``None``.

    ``name`` may be an exact key (``"V100-SXM2-16GB"``), a generation (``"V100"``) or an NVML name
    (``"NVIDIA A100-SXM4-80GB"``, ``"Tesla V100-PCIE-16GB"``). Among several matches the one whose
    datasheet label (GB) or driver-visible total (GiB) is closest to ``memory_gib`` wins, so
    ``("V100", 16)`` finds a 16 GB part; a form factor named in ``name`` (SXM / PCIe) breaks ties,
    else catalog order does.
    """
    if not name:
        return None
    catalog = gpu_catalog()
    if name in catalog:
        return catalog[name]
    needle = _tokens(name.upper().replace("NVIDIA", "").replace("TESLA", "").replace("GEFORCE", ""))
    matches = [spec for key, spec in catalog.items() if _contains(needle, _family(key))]
    if not matches:
        return None
    wants_pcie = any(t.startswith("PCIE") for t in needle)
    wants_sxm = any(t.startswith("SXM") for t in needle)

    def form_mismatch(spec: GpuSpec) -> int:
        is_pcie = "PCIE" in _tokens(spec.model_name)
        return int((wants_pcie and not is_pcie) or (wants_sxm and is_pcie))

    def memory_gap(spec: GpuSpec) -> float:
        if memory_gib is None:
            return 0.0
        return min(abs(spec.memory_label_gb - memory_gib), abs(spec.memory_gib - memory_gib))

    return min(matches, key=lambda s: (memory_gap(s), form_mismatch(s)))


def _tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[\s\-_]+", text.upper()) if t]


def _family(key: str) -> list[str]:
    """Tokens of a catalog key without form factor and memory (``V100-SXM2-16GB`` -> ``[V100]``)."""
    return [t for t in _tokens(key) if not re.fullmatch(r"SXM\d*|PCIE|\d+GB", t)]


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))
