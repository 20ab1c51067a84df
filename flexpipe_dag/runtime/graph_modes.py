"""The values of ``RuntimeOptions.decode_graphs`` / ``WorkerSpec.decode_graphs`` (torch-free, so the head's
option checks and the worker spec need not import :mod:`~flexpipe_dag.runtime.decode_graphs`)."""

from __future__ import annotations

#: ``auto`` (CUDA graphs for decode steps on CUDA devices, none on a CPU), ``off``, ``eager`` (the padded
#: static-shape decode path without capture, on any device; :mod:`~flexpipe_dag.runtime.decode_graphs`).
DECODE_GRAPH_MODES = ("auto", "off", "eager")
