"""The work of an observed stage step, by operator class, in the cost model's own counts.

A step packs every sequence's new tokens into one ``[T, hidden]`` batch (the runtime's layout,
vLLM-style): projections, norms and MLPs run over all ``T`` tokens, attention scores
``attended_pairs`` query-key pairs and reads ``kv_context_tokens`` cached tokens. Its work per
decoder layer is :func:`flexpipe_dag.planner.operators.layer_work_by_class` at those counts, times
the stage's layers, plus the embedding of ``T`` tokens on the first stage and the final norm + LM
head for one logit row per sequence on the last (each segment priced on its own, as the cost model
does). For a pure decode step and a single-prompt
prefill this is exactly what :meth:`~flexpipe_dag.planner.cost_model.CostModel.stage_decode_ms` /
``stage_prefill_ms`` price (checked in the tests), so factors fitted on it are the cost model's.

Per class the roofline splits into three unit times at efficiency 1 on the device's profiled peak
(:func:`roofline_terms`), which the fit then scales::

    t = sum_c  kernels_c * overhead_c / a_o  +  max( flops_c / (P e_c a_c),  bytes_c / (W m_c a_m) )
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from flexpipe_dag.calibration.observation import StageObservation
from flexpipe_dag.planner.cost_model import Efficiency
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.planner.operators import (
    OP_CLASSES,
    embedding_work_by_class,
    head_work_by_class,
    layer_work_by_class,
)

WorkByClass = dict[str, tuple[float, float, int]]
#: A step's work in segments priced separately (as the cost model does): decoder layers, embedding, head.
SEGMENTS: tuple[str, ...] = ("layers", "embedding", "head")
StepWork = dict[str, WorkByClass]


def step_work_by_class(model: ModelSpec, obs: StageObservation, dtype: str) -> StepWork:
    """``{segment: {op_class: (flops, bytes_moved, kernels)}}`` of one observed step (see module docstring).

    Segments are kept apart because the cost model takes the roofline max per class *per segment*
    (the LM head's GEMM is bandwidth-bound while the layers' GEMMs may be compute-bound).
    """
    layer = layer_work_by_class(model, float(obs.num_tokens), float(obs.attended_pairs),
                                float(obs.kv_context_tokens), dtype)
    k = obs.num_layers
    out: StepWork = {"layers": {c: (k * f, k * b, k * n) for c, (f, b, n) in layer.items()}}
    if obs.is_first:
        out["embedding"] = embedding_work_by_class(model, float(obs.num_tokens), dtype)
    if obs.is_last:
        out["head"] = head_work_by_class(model, float(obs.num_seqs), dtype)
    return out


def roofline_terms(works: Sequence[StepWork], peak_tflops: float, hbm_bandwidth_gbps: float,
                   efficiency: Mapping[str, Efficiency]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unit-time terms of each step, ms, shape ``(num_steps, len(SEGMENTS) * len(OP_CLASSES))`` each.

    Returns:
        ``(compute_ms, memory_ms, overhead_ms)``: per step, segment and class, ``flops / (P e_c)``,
        ``bytes / (W m_c)`` and ``kernels * overhead_c``, with the given (prior) efficiencies.
        With multipliers ``(a_c, a_m, a_o)`` the step takes
        ``sum (overhead / a_o + max(compute / a_c, memory / a_m))`` over the columns.
    """
    n, k = len(works), len(SEGMENTS) * len(OP_CLASSES)
    tc, tm, to = np.zeros((n, k)), np.zeros((n, k)), np.zeros((n, k))
    for i, w in enumerate(works):
        for si, seg in enumerate(SEGMENTS):
            for cj, c in enumerate(OP_CLASSES):
                f, b, kern = w.get(seg, {}).get(c, (0.0, 0.0, 0))
                e = efficiency[c]
                j = si * len(OP_CLASSES) + cj
                tc[i, j] = f / (peak_tflops * 1e12 * e.compute) * 1e3
                tm[i, j] = b / (hbm_bandwidth_gbps * 1e9 * e.memory) * 1e3
                to[i, j] = kern * e.overhead_us / 1e3
    return tc, tm, to


def predict_terms_ms(tc: np.ndarray, tm: np.ndarray, to: np.ndarray, a_compute: float = 1.0, a_memory: float = 1.0,
                     a_overhead: float = 1.0) -> np.ndarray:
    """Step times, ms, ``(num_steps,)``, for multipliers on achieved compute / bandwidth / overhead rate."""
    step_ms: np.ndarray = (to / a_overhead + np.maximum(tc / a_compute, tm / a_memory)).sum(axis=1)
    return step_ms
