"""Workloads: real request traces (Azure LLM 2023, generic CSV/JSONL, length-only backlogs), the
ServeGen daily tide, and transforms (speedup, tide shaping, online + offline mixing).

Pure data in, plain data out (pandas / numpy only).
"""

from flexpipe_dag.workload.bundled import BUNDLED_TRACES, bundled_path, load_tide_trace, load_trace, traces_dir
from flexpipe_dag.workload.context import (
    CONTEXT_POLICIES,
    ContextPolicy,
    ContextReport,
    ContextResult,
    apply_context_rule,
    fit_to_context,
)
from flexpipe_dag.workload.loaders import UnsortedTraceWarning, load_azure_trace, load_length_file, load_request_file
from flexpipe_dag.workload.request import Request, Workload, to_plain_dicts, write_requests_jsonl
from flexpipe_dag.workload.tide import (
    Tide,
    aggregate_servegen_rates,
    load_tide,
    shape_by_tide,
    tide_arrivals,
    tide_from_frame,
)
from flexpipe_dag.workload.transform import as_class, head, mix, sample_chunks, speedup, time_window

__all__ = [
    "BUNDLED_TRACES", "CONTEXT_POLICIES", "ContextPolicy", "ContextReport", "ContextResult", "Request", "Tide",
    "UnsortedTraceWarning", "Workload", "aggregate_servegen_rates", "apply_context_rule", "as_class", "bundled_path",
    "fit_to_context", "head", "load_azure_trace", "load_length_file", "load_request_file", "load_tide",
    "load_tide_trace", "load_trace", "mix", "sample_chunks", "shape_by_tide", "speedup", "tide_arrivals", "tide_from_frame",
    "time_window", "to_plain_dicts", "traces_dir", "write_requests_jsonl",
]
