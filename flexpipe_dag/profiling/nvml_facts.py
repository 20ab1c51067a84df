"""Device facts from NVIDIA's management library (pynvml, from the ``nvidia-ml-py`` distribution).

Failures are reported, never swallowed: :func:`read_nvml_facts` returns the error text beside
whatever it could read, and the prober writes it into the profile's notes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

_T = TypeVar("_T")


@dataclass
class NvmlReport:
    """What NVML said: one dict of facts per GPU (index order), and any errors met on the way."""

    devices: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _try(report: NvmlReport, what: str, fn: Callable[..., _T], *args: Any) -> _T | None:
    """``fn(*args)``, or None with the NVML error recorded in ``report`` under ``what``."""
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        report.errors.append(f"{what}: {exc}")
        return None


def read_nvml_facts() -> NvmlReport:
    """Read name, memory (GiB), clocks (MHz), PCIe generation/width and NVLink state of every GPU.

    Never raises for NVML problems: on a host without the NVIDIA driver the report holds no devices
    and one error (``NVML Shared Library Not Found``).
    """
    report = NvmlReport()
    try:
        import pynvml
    except ImportError as exc:  # the dependency is declared; this means a broken install
        report.errors.append(f"pynvml import failed: {exc}")
        return report
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        report.errors.append(f"nvmlInit: {exc}")
        return report
    try:
        count = _try(report, "nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount) or 0
        for i in range(count):
            h = _try(report, f"gpu{i} handle", pynvml.nvmlDeviceGetHandleByIndex, i)
            if h is None:
                continue
            mem = _try(report, f"gpu{i} memory", pynvml.nvmlDeviceGetMemoryInfo, h)
            facts: dict[str, Any] = {
                "index": i,
                "name": _try(report, f"gpu{i} name", pynvml.nvmlDeviceGetName, h),
                "uuid": _try(report, f"gpu{i} uuid", pynvml.nvmlDeviceGetUUID, h),
                "memory_total_gib": mem.total / 2**30 if mem else None,
                "memory_free_gib": mem.free / 2**30 if mem else None,
                "sm_clock_max_mhz": _try(report, f"gpu{i} sm clock", pynvml.nvmlDeviceGetMaxClockInfo, h,
                                         pynvml.NVML_CLOCK_SM),
                "mem_clock_max_mhz": _try(report, f"gpu{i} mem clock", pynvml.nvmlDeviceGetMaxClockInfo, h,
                                          pynvml.NVML_CLOCK_MEM),
                "pcie_gen": _try(report, f"gpu{i} pcie gen", pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                "pcie_width": _try(report, f"gpu{i} pcie width", pynvml.nvmlDeviceGetCurrPcieLinkWidth, h),
            }
            nvlinks = []
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    nvlinks.append(bool(pynvml.nvmlDeviceGetNvLinkState(h, link)))
                except pynvml.NVMLError:
                    break  # past the last link (or no NVLink): not an error
            facts["nvlink_active_links"] = sum(nvlinks)
            report.devices.append(facts)
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            report.errors.append(f"nvmlShutdown: {exc}")
    return report
