"""The layer split of an offline run over identical stage workers on this host (``flexpipe run --stages N``),
from the run's own prompts and one stage worker measured here.

The worker is measured in the run's dtype, with the worker's thread count, in about 0.1-0.3 s: a square GEMM's
FLOP/s (:func:`~flexpipe_dag.profiling.microbench.gemm_tflops`, as the probe measures a device) for the
compute-bound prefill steps, and the weight bytes per second of a micro-batch's rows times a 64 MiB weight
(:func:`~flexpipe_dag.profiling.microbench.weight_read_gbps`) for the decode steps, which read every weight once
per step. A plain memory copy says too little about the second on a CPU: measured on this 2-core host (one
thread, fp32), a copy moves 43 GB/s, one row times the weight reads it at 24 GB/s and 8 rows at 9 GB/s, and a
SmolLM2-135M decode step of 8 sequences reads its 540 MB of weights at 7.6 GB/s. The cost model's roofline then
prices both kinds of step on this host's own balance of the two; the split itself is the planner's
(:mod:`flexpipe_dag.planner.workload_split`).
"""

from __future__ import annotations

import datetime as dt
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flexpipe_dag.core.cluster import REFERENCE_TFLOPS, ClusterProfile, Device
from flexpipe_dag.planner.cost_model import CostModel
from flexpipe_dag.planner.model_spec import ModelSpec
from flexpipe_dag.planner.workload_split import MAX_PRICED_ROWS, WorkloadCost, workload_cost, workload_layer_counts

if TYPE_CHECKING:
    from flexpipe_dag.core.gear import Gear
    from flexpipe_dag.runtime.batch import PromptRow
    from flexpipe_dag.runtime.model_loader import Checkpoint

#: GEMM edge of the worker measurement: on a CPU core a 512 x 512 fp32 product takes a few ms; on a GPU the
#: larger product reaches its tensor-core rate.
CPU_GEMM_N, GPU_GEMM_N = 512, 4096


@dataclass(frozen=True)
class WorkloadSplit:
    """Layers per stage for a workload, and what they were derived from.

    Attributes:
        layers_per_stage: decoder layers of each stage, in order.
        work: the workload priced on one worker (:class:`~flexpipe_dag.planner.workload_split.WorkloadCost`).
        stage_ms: each stage's modelled time over the priced rows, ms (divided by its replicas).
        peak_tflops, bandwidth_gbps: the worker as measured.
    """

    layers_per_stage: list[int]
    work: WorkloadCost
    stage_ms: list[float]
    peak_tflops: float
    bandwidth_gbps: float

    def describe(self) -> str:
        """One line for the run's banner: the modelled stage times and the worker's figures. The times are relative:
        their balance decides the split, but the run's own stage times differ from them by a factor (0.65-2.3x in
        ``bench/runtime_bench.py`` on a 2-core host, by batch size and depth), so the line says so."""
        times = ", ".join(f"{t / 1e3:.1f}" for t in self.stage_ms)
        return (f"layers split for these prompts: {self.layers_per_stage}, modelled stage time {times} s (their "
                f"balance sets the split, not a forecast of the run's time; one worker here: "
                f"{self.peak_tflops * 1e3:.0f} GFLOP/s, {self.bandwidth_gbps:.1f} GB/s)")


def measure_worker(device: str, dtype: str, micro_batch_size: int, threads: int = 1) -> Device:
    """One stage worker of this host as a :class:`~flexpipe_dag.core.cluster.Device`: a GEMM's TFLOP/s and the
    weight-read GB/s of ``micro_batch_size`` rows (:func:`~flexpipe_dag.profiling.microbench.weight_read_gbps`) on
    ``device`` (``"cpu"`` or ``"cuda[:N]"``) in ``dtype`` (a canonical runtime dtype), with ``threads`` torch
    threads on a CPU (the runtime gives each worker one). The calling process's thread count is restored
    afterwards."""
    import torch

    from flexpipe_dag.profiling.microbench import gemm_tflops, weight_read_gbps
    from flexpipe_dag.runtime.model_loader import torch_dtype

    dev = torch.device(device)
    before = torch.get_num_threads()
    try:
        if dev.type == "cpu":
            torch.set_num_threads(threads)
        tflops = gemm_tflops(dev, torch_dtype(dtype), CPU_GEMM_N if dev.type == "cpu" else GPU_GEMM_N)
        gbps = weight_read_gbps(dev, torch_dtype(dtype), micro_batch_size)
    finally:
        torch.set_num_threads(before)
    memory_gib = (torch.cuda.get_device_properties(dev).total_memory / 2**30 if dev.type == "cuda" else 1.0)
    return Device(device_id="worker", node_id=socket.gethostname() or "host",
                  kind="cuda" if dev.type == "cuda" else "cpu-worker", memory_gib=memory_gib, peak_tflops=tflops,
                  hbm_bandwidth_gbps=gbps, compute_score=tflops / REFERENCE_TFLOPS)


def split_for_workload(spec: ModelSpec, worker: Device, dtype: str, num_stages: int, prompt_tokens: Sequence[int],
                       output_tokens: Sequence[int], micro_batch_size: int,
                       replicas: Sequence[int] | None = None) -> WorkloadSplit:
    """Layers per stage for ``num_stages`` stages of workers like ``worker``: the min-bottleneck split of the
    workload's modelled time, a stage of ``r`` replicas counting ``1 / r`` of its time (its sequences are shared
    over ``r`` lanes).

    Args:
        spec: the model's architecture facts.
        worker: one stage worker (:func:`measure_worker`).
        dtype: the weights' and activations' dtype (canonical).
        num_stages: stages (1..layers).
        prompt_tokens, output_tokens: per row, prompt tokens and output tokens (``max_new_tokens``).
        micro_batch_size: sequences per micro-batch.
        replicas: workers per stage (default one each).

    Raises:
        ValueError: as :func:`~flexpipe_dag.planner.workload_split.workload_cost`, or replicas not one count >= 1
            per stage.
        InfeasibleError: ``num_stages`` outside ``1..layers``.
    """
    reps = list(replicas) if replicas is not None else [1] * num_stages
    cluster = ClusterProfile(cluster_id="this-host", devices=[worker], source="probe",
                             measured_at=dt.datetime.now(dt.UTC))
    cost = CostModel(spec, cluster, dtype=dtype)
    work = workload_cost(cost, worker.device_id, prompt_tokens, output_tokens, micro_batch_size)
    sizes = workload_layer_counts(work, spec.num_layers, num_stages, reps)
    last = num_stages - 1
    stage_ms = [work.stage_ms(n, i == 0, i == last) / reps[i] for i, n in enumerate(sizes)]
    return WorkloadSplit(sizes, work, stage_ms, worker.peak_tflops, worker.hbm_bandwidth_gbps)


def split_gear_for_rows(gear: Gear, ckpt: Checkpoint, rows: Sequence[PromptRow], done_ids: set[str],
                        apply_template: bool, device: str, dtype: str,
                        truncate_context: bool = False) -> tuple[Gear, WorkloadSplit | None]:
    """``gear`` (an even split over identical local workers, e.g. ``flexpipe run --stages N`` or the
    ``batch_inference`` job's ``stages:``) with its layers split for the rows still to run: the first
    :data:`~flexpipe_dag.planner.workload_split.MAX_PRICED_ROWS` rows whose id is not in ``done_ids``, their text
    prompts tokenised as the run sends them (``apply_template``: wrapped in the chat template), one worker measured
    on ``device`` (``"cpu"`` / ``"cuda:N"``) in ``dtype`` (canonical). The gear's replicas, micro-batch size,
    in-flight bound and KV capacity are kept; its id names the split (``split-N-<a>x<b>...``, or ``uniform-N``
    when the split is even). Only rows the runtime will serve are priced, as it will serve them: a row whose
    token ids fall outside the model's vocabulary, or whose prompt + ``max_new_tokens`` exceed the model's max
    context, is left out (the run refuses it), unless ``truncate_context`` cuts its prompt to fit, when it is
    priced at the cut length.

    Returns:
        The gear and the split (whose :meth:`WorkloadSplit.describe` is the line to log), or ``gear`` itself and
        None when no row is left to run.

    Raises:
        ValueError / InfeasibleError: as :func:`split_for_workload`.
    """
    from flexpipe_dag.core.gear_builders import even_gear
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.runtime.chat_template import prompt_token_ids

    tok = ckpt.tokenizer()
    vocab = int(getattr(ckpt.config, "vocab_size", 0) or 0)
    max_context = ckpt.max_context_tokens
    prompts: list[int] = []
    outputs: list[int] = []
    for r in rows:
        if len(prompts) == MAX_PRICED_ROWS:
            break
        if r.request_id in done_ids:
            continue
        if r.token_ids is not None and vocab and any(not 0 <= t < vocab for t in r.token_ids):
            continue  # refused by the run as malformed
        p = max(1, len(r.token_ids if r.token_ids is not None else prompt_token_ids(tok, r.prompt or "", apply_template)))
        o = max(1, r.max_new_tokens)
        if max_context and p + o > max_context:
            if not truncate_context or o >= max_context:
                continue  # refused by the run: over the context
            p = max_context - o
        prompts.append(p)
        outputs.append(o)
    if not prompts:
        return gear, None
    replicas = [st.replicas for st in gear.stages]
    split = split_for_workload(load_model_spec(ckpt.path), measure_worker(device, dtype, gear.micro_batch_size), dtype,
                               gear.num_stages, prompts, outputs, gear.micro_batch_size, replicas)
    return even_gear(ckpt.num_layers, gear.num_stages, ckpt.name, gear.micro_batch_size,
                     gear.max_inflight_micro_batches, gear.kv_capacity_tokens, replicas,
                     layers_per_stage=split.layers_per_stage), split
