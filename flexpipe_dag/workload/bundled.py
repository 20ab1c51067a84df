"""Traces shipped inside the package (``flexpipe_dag/data/traces``) and name-or-path resolution.

Bundled names: ``azure-conv``, ``azure-code`` (Azure LLM inference 2023, CC-BY-4.0),
``arxiv-summarization`` (first 2,000 rows of vidur's length-only file, MIT; offline backlog),
``servegen-tide`` (ServeGen m_small 43 clients summed per 600 s window over 14 days, Apache-2.0).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from flexpipe_dag.core.errors import InputError, shown
from flexpipe_dag.workload.files import read_user_header
from flexpipe_dag.workload.loaders import load_azure_trace, load_length_file, load_request_file
from flexpipe_dag.workload.request import Workload
from flexpipe_dag.workload.tide import Tide, load_tide

#: bundled name -> (file name under flexpipe_dag/data/traces, format)
BUNDLED_TRACES: dict[str, tuple[str, str]] = {
    "azure-conv": ("AzureLLMInferenceTrace_conv.csv", "azure"),
    "azure-code": ("AzureLLMInferenceTrace_code.csv", "azure"),
    "arxiv-summarization": ("arxiv_summarization_first2000.csv", "lengths"),
    "servegen-tide": ("servegen_tide_14d.csv", "tide"),
}


def traces_dir() -> Path:
    """Directory of the bundled trace files."""
    return Path(str(resources.files("flexpipe_dag.data").joinpath("traces")))


def bundled_path(name: str) -> Path:
    """Path of a bundled trace by name.

    Raises:
        InputError: unknown name (the message lists the known ones).
    """
    if name not in BUNDLED_TRACES:
        raise InputError(None, "trace", f"unknown bundled trace {shown(name)}; expected one of {sorted(BUNDLED_TRACES)} or a file path")
    return traces_dir() / BUNDLED_TRACES[name][0]


def _detect_format(path: Path) -> str:
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        return "generic"
    header = read_user_header(path, "request trace (CSV or JSONL)")
    if "TIMESTAMP" in header:
        return "azure"
    if "num_prefill_tokens" in header:
        return "lengths"
    if "total_rate_req_per_s" in header:
        return "tide"
    return "generic"


def load_trace(name_or_path: str | Path) -> Workload:
    """Load a request trace given a bundled name or a file path; the format is detected from the header.

    Azure CSVs -> online requests; generic CSV / JSONL -> as written; length-only files -> an
    offline backlog at 0 s.

    Raises:
        InputError: unknown name, missing file, a tide file (use :func:`load_tide_trace`), bad rows.
    """
    key = str(name_or_path)
    path = bundled_path(key) if key in BUNDLED_TRACES else Path(key)
    requests = sorted(n for n, (_, fmt) in BUNDLED_TRACES.items() if fmt != "tide")
    if not path.exists():
        raise InputError(str(path), None, f"file not found; expected a trace path or one of {requests}")
    fmt = _detect_format(path)
    if fmt == "azure":
        return load_azure_trace(path, name=key if key in BUNDLED_TRACES else None)
    if fmt == "lengths":
        return load_length_file(path, name=key if key in BUNDLED_TRACES else None)
    if fmt == "tide":
        raise InputError(str(path), None, f"this is a rate series (tide), not requests; expected a request trace "
                                          f"(a file, or one of {requests})")
    return load_request_file(path)


def load_tide_trace(name_or_path: str | Path = "servegen-tide") -> Tide:
    """Load a tide (default: the bundled ServeGen 14-day tide)."""
    key = str(name_or_path)
    return load_tide(bundled_path(key) if key in BUNDLED_TRACES else Path(key))
