"""Gears built without the planner: a hand-specified split (tests, measured tables, what-if runs), an
even split over placeholder workers (``flexpipe run --stages``, batch jobs, benches), and a gear saved
as a JSON file (one element of ``flexpipe plan --json``'s ``gears`` list)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from flexpipe_dag.core.errors import InputError, validation_input_error
from flexpipe_dag.core.gear import MAX_INFLIGHT_MICRO_BATCHES, Gear, StagePlan
from flexpipe_dag.core.user_yaml import load_user_document


def even_layer_counts(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts that differ by at most one, earlier stages taking the remainder
    (``even_layer_counts(30, 4) == [8, 8, 7, 7]``). The caller checks ``1 <= num_stages <= num_layers``."""
    base, extra = divmod(num_layers, num_stages)
    return [base + 1 if i < extra else base for i in range(num_stages)]


def inflight_to_fill(servers: int, sequences: int, micro_batch_size: int) -> int:
    """Micro-batches to keep in flight so that ``sequences`` sequences in micro-batches of ``micro_batch_size`` keep
    every one of ``servers`` stage workers (the stages' replicas, summed) busy: ``max(ceil(sequences / b), servers)``,
    at most :data:`~flexpipe_dag.core.gear.MAX_INFLIGHT_MICRO_BATCHES`. The planner sizes a gear this way for its
    planned concurrency; an offline run (``flexpipe run``, the ``batch_inference`` job) for its prompts. The running
    set is still bounded by the KV pool (a sequence is admitted only while it has free blocks).

    Why more than one per server: with one micro-batch per stage a stage waits, after each step, for the driver to
    turn the last stage's result into the next micro-batch. Measured on a 2-core host (2 stages, micro-batch 8, 64
    requests, against ``transformers`` ``generate`` in the same run): ``bench/runtime_bench.py`` 1.02-1.09x with 2 in
    flight, 1.17-1.19x with 8 (3 stages: 1.06-1.07x -> 1.15-1.25x); at micro-batch 1, 1.51x -> 1.79x.
    """
    return min(max(1, math.ceil(sequences / micro_batch_size), servers), MAX_INFLIGHT_MICRO_BATCHES)


def stages_from_counts(layers_per_stage: Sequence[int], device_ids: Sequence[Sequence[str]]) -> list[StagePlan]:
    """Contiguous stages: stage ``i`` holds the next ``layers_per_stage[i]`` layers on ``device_ids[i]``
    (one device per replica)."""
    stages, start = [], 0
    for i, (n, devices) in enumerate(zip(layers_per_stage, device_ids)):
        stages.append(StagePlan(stage_index=i, layer_start=start, layer_end=start + n, device_ids=list(devices)))
        start += n
    return stages


def manual_gear(
    layers_per_stage: Sequence[int],
    *,
    replicas: Sequence[int] | None = None,
    gear_id: str = "manual",
    model_name: str = "model",
    micro_batch_size: int = 1,
    max_inflight_micro_batches: int = 1,
    kv_block_size_tokens: int = 16,
    kv_capacity_tokens: int = 0,
    target_p99_ms: float = 1000.0,
) -> Gear:
    """A ``kind="manual"`` gear with stage ``i`` holding ``layers_per_stage[i]`` layers on
    ``replicas[i]`` devices named ``d<i>r<j>`` (device names are placeholders for simulation).

    Raises:
        pydantic.ValidationError: via :class:`Gear` (e.g. an empty stage).
        ValueError: ``replicas`` length differs from ``layers_per_stage``.
    """
    reps = list(replicas) if replicas is not None else [1] * len(layers_per_stage)
    if len(reps) != len(layers_per_stage):
        raise ValueError(f"replicas: expected {len(layers_per_stage)} entries, got {len(reps)}")
    stages = stages_from_counts(layers_per_stage, [[f"d{i}r{j}" for j in range(r)] for i, r in enumerate(reps)])
    return Gear(gear_id=gear_id, kind="manual", model_name=model_name, num_layers=sum(layers_per_stage), stages=stages,
                micro_batch_size=micro_batch_size, max_inflight_micro_batches=max_inflight_micro_batches,
                kv_block_size_tokens=kv_block_size_tokens, kv_capacity_tokens=kv_capacity_tokens,
                target_p99_ms=target_p99_ms)


def even_gear(num_layers: int, num_stages: int, model_name: str, micro_batch_size: int, inflight: int | None,
              kv_capacity_tokens: int, replicas: list[int] | None = None,
              layers_per_stage: Sequence[int] | None = None) -> Gear:
    """A gear over placeholder stage workers: layers split as evenly as possible (earlier stages take the
    remainder; a ``uniform`` gear, ``uniform-<N>``), or as ``layers_per_stage`` says (a ``manual`` gear,
    ``split-<N>-<a>x<b>...``, e.g. a split for an offline run's prompts); stage ``i`` on ``replicas[i]`` workers
    named ``worker<i>`` (``worker<i>.<k>`` when replicated, the id then ending ``-r<r0>x<r1>...``).

    ``inflight``: micro-batches in flight (None = one per stage).

    Raises:
        InputError: a stage count outside ``1..num_layers`` (``--stages``), or replicas not one count
            >= 1 per stage (``--stage-replicas``).
        ValueError: ``layers_per_stage`` not ``num_stages`` counts >= 1 summing to ``num_layers``.
    """
    if not 1 <= num_stages <= num_layers:
        raise InputError(None, "--stages", f"expected 1..{num_layers}, got {num_stages}")
    replicas = replicas or [1] * num_stages
    if len(replicas) != num_stages or min(replicas) < 1:
        raise InputError(None, "--stage-replicas", f"expected {num_stages} counts >= 1 (one per stage), got {replicas}")
    even = even_layer_counts(num_layers, num_stages)
    counts = list(layers_per_stage) if layers_per_stage is not None else even
    if len(counts) != num_stages or min(counts) < 1 or sum(counts) != num_layers:
        raise ValueError(f"layers_per_stage: expected {num_stages} counts >= 1 summing to {num_layers}, got {counts}")
    devices = [[f"worker{i}"] if r == 1 else [f"worker{i}.{k}" for k in range(r)] for i, r in enumerate(replicas)]
    stages = stages_from_counts(counts, devices)
    suffix = "-r" + "x".join(map(str, replicas)) if max(replicas) > 1 else ""
    gear_id = f"uniform-{num_stages}" if counts == even else f"split-{num_stages}-" + "x".join(map(str, counts))
    return Gear(gear_id=gear_id + suffix, kind="uniform" if counts == even else "manual", model_name=model_name,
                num_layers=num_layers, stages=stages, micro_batch_size=micro_batch_size,
                max_inflight_micro_batches=inflight or num_stages, kv_capacity_tokens=kv_capacity_tokens)


def load_gear(path: str | Path) -> Gear:
    """The gear saved in ``path``: strict JSON when the name ends in ``.json``, else strict YAML (or JSON).

    Read through the capped reader and parsed strictly (:func:`~flexpipe_dag.core.user_yaml.load_user_document`):
    a duplicate key (two ``gear_id``), ``NaN`` / ``Infinity``, an alias or a non-standard YAML tag is refused,
    and every figure is checked against the bounds of :class:`Gear` (e.g. ``micro_batch_size`` 1..65536).
    Validation is strict, as a cluster profile's numbers are: a boolean (YAML's ``yes`` / ``true``), a string
    (``"32"``) or a float (``32.0``) where an integer belongs is refused, not converted (``true`` read as a
    micro-batch of 1, ``false`` as stage 0).

    Raises:
        InputError: the file is missing or unreadable, not a regular file, over
            :data:`~flexpipe_dag.core.user_files.MAX_JSON_BYTES` (JSON) or
            :data:`~flexpipe_dag.core.user_files.MAX_YAML_BYTES` (YAML), not UTF-8, not strict JSON / YAML,
            an empty document or not a mapping, or a field is invalid (named by its path, e.g.
            ``stages[0].est_stage_ms``, with the value given: :func:`~flexpipe_dag.core.errors.validation_input_error`).
    """
    from pydantic import ValidationError

    path = Path(path)
    if not path.exists():
        raise InputError(str(path), None, "file not found; expected a gear as JSON or YAML")
    data = load_user_document(path, "gear")
    if not isinstance(data, dict):  # None: an empty file, or one holding only comments
        got = "no document" if data is None else f"a {type(data).__name__}"
        raise InputError(str(path), None, f"the file holds {got}; expected a mapping of a gear's fields "
                                          "(gear_id, model_name, num_layers, stages, micro_batch_size, ...)")
    try:
        return Gear.model_validate(data, strict=True)
    except ValidationError as exc:
        raise validation_input_error(str(path), exc) from None
