"""What a shift between two gears costs: weight bytes that must move, their transfer time, drain time.

Design formula (``DESIGN.md``, seed figures): migration cost = bytes moved / link bandwidth + drain
time. Pure functions, plain data in and out; units in every name.

A layer must move to a device when the new gear places it there and the old gear did not (replicas
count: every new replica device lacking the layer receives a copy). It is copied from the old
device holding it with the fastest link to the destination. Copies into *different* destination
devices run in parallel; copies into *one* device run one after another (its ingress is the
bottleneck), so the transfer time is the maximum over destination devices of the sum of its
incoming copy times (:meth:`flexpipe_dag.core.cluster.Link.transfer_ms`: latency + bytes /
bandwidth).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flexpipe_dag.core.cluster import ClusterProfile, Link
from flexpipe_dag.core.errors import InfeasibleError, InputError
from flexpipe_dag.core.gear import Gear


@dataclass(frozen=True)
class LayerMove:
    """One decoder layer (or the embedding / LM head) copied from one device to another.

    ``layer`` is the 0-based decoder layer index, ``-1`` for the embedding (charged to the first
    stage) and ``num_layers`` for the final norm + LM head (charged to the last stage).
    """

    layer: int
    src_device_id: str
    dst_device_id: str
    num_bytes: float


def _placement(gear: Gear) -> dict[int, set[str]]:
    """``layer -> devices holding it`` including the embedding (-1) and LM head (num_layers)."""
    out: dict[int, set[str]] = {}
    for st in gear.stages:
        for layer in range(st.layer_start, st.layer_end):
            out[layer] = set(st.device_ids)
    out[-1] = set(gear.stages[0].device_ids)
    out[gear.num_layers] = set(gear.stages[-1].device_ids)
    return out


def _best_link(cluster: ClusterProfile, sources: set[str], dst: str,
               fallback_bandwidth_gbps: float | None) -> tuple[str, Link]:
    best: tuple[str, Link] | None = None
    for src in sorted(sources):
        link = cluster.link(src, dst)
        if link is not None and (best is None or link.bandwidth_gbps > best[1].bandwidth_gbps):
            best = (src, link)
    if best is not None:
        return best
    if fallback_bandwidth_gbps is None:
        raise InfeasibleError(
            f"no link from any of {sorted(sources)} to {dst!r} in cluster {cluster.cluster_id!r} and no "
            "fallback_bandwidth_gbps (e.g. host storage) given to load the weights from")
    src = sorted(sources)[0]
    return src, Link(src_device_id=src, dst_device_id=dst, bandwidth_gbps=fallback_bandwidth_gbps,
                     latency_us=0.0, kind="fallback")


def _check_weights(gear: Gear, layer_weight_bytes: Sequence[float], source: str) -> None:
    if len(layer_weight_bytes) != gear.num_layers:
        raise InputError(source, "layer_weight_bytes",
                         f"expected {gear.num_layers} entries (one per decoder layer of {gear.model_name}), "
                         f"got {len(layer_weight_bytes)}")
    for i, b in enumerate(layer_weight_bytes):
        if not (b >= 0 and math.isfinite(b)):
            raise InputError(source, f"layer_weight_bytes[{i}]", f"expected finite bytes >= 0, got {b!r}")


def layer_moves(from_gear: Gear, to_gear: Gear, layer_weight_bytes: Sequence[float], *,
                embedding_bytes: float = 0.0, lm_head_bytes: float = 0.0) -> list[LayerMove]:
    """Layers each device of ``to_gear`` lacks under ``from_gear`` (one :class:`LayerMove` each).

    Args:
        from_gear, to_gear: the two gears; same model and layer count.
        layer_weight_bytes: bytes of weights per decoder layer, length ``num_layers``.
        embedding_bytes, lm_head_bytes: bytes of the embedding (first stage) and final norm + LM
            head (last stage); 0 to ignore them.

    Returns:
        Moves sorted by (destination device, layer); ``src_device_id`` is the lexicographically
        first old holder (:func:`weight_transfer_s` picks the holder with the fastest link).

    Raises:
        InputError: the gears differ in layer count, or ``layer_weight_bytes`` has the wrong length
            or a negative / non-finite entry.
    """
    if from_gear.num_layers != to_gear.num_layers:
        raise InputError("gears", "num_layers",
                         f"{from_gear.gear_id} has {from_gear.num_layers} layers, {to_gear.gear_id} has "
                         f"{to_gear.num_layers}; a shift keeps the model")
    _check_weights(to_gear, layer_weight_bytes, "migration")
    old = _placement(from_gear)
    new = _placement(to_gear)
    size = {i: float(b) for i, b in enumerate(layer_weight_bytes)}
    size[-1] = float(embedding_bytes)
    size[to_gear.num_layers] = float(lm_head_bytes)
    moves: list[LayerMove] = []
    for layer in sorted(new):
        for dst in sorted(new[layer] - old[layer]):
            if size[layer] > 0:
                moves.append(LayerMove(layer, sorted(old[layer])[0], dst, size[layer]))
    moves.sort(key=lambda m: (m.dst_device_id, m.layer))
    return moves


def bytes_to_move(from_gear: Gear, to_gear: Gear, layer_weight_bytes: Sequence[float], *,
                  embedding_bytes: float = 0.0, lm_head_bytes: float = 0.0) -> float:
    """Total weight bytes a shift ``from_gear -> to_gear`` must copy (see :func:`layer_moves`)."""
    return sum(m.num_bytes for m in layer_moves(from_gear, to_gear, layer_weight_bytes,
                                                embedding_bytes=embedding_bytes, lm_head_bytes=lm_head_bytes))


def weight_transfer_s(from_gear: Gear, to_gear: Gear, cluster: ClusterProfile,
                      layer_weight_bytes: Sequence[float], *, embedding_bytes: float = 0.0,
                      lm_head_bytes: float = 0.0, fallback_bandwidth_gbps: float | None = None) -> float:
    """Seconds to copy the weights a shift needs over the cluster's links.

    Each move is copied from the old holder with the highest-bandwidth link to its destination;
    destinations load in parallel, each one's copies in sequence (module docstring).

    Args:
        cluster: supplies ``link(src, dst)``; ``bandwidth_gbps`` in GB/s, ``latency_us`` in us.
        fallback_bandwidth_gbps: GB/s to assume (e.g. host storage / PCIe from CPU memory) when no
            old holder has a link to the destination; None makes that an error.

    Raises:
        InputError: see :func:`layer_moves`.
        InfeasibleError: a destination has no link from any holder and no fallback is given.
    """
    old = _placement(from_gear)
    per_dst_ms: dict[str, float] = {}
    for move in layer_moves(from_gear, to_gear, layer_weight_bytes, embedding_bytes=embedding_bytes,
                            lm_head_bytes=lm_head_bytes):
        _, link = _best_link(cluster, old[move.layer], move.dst_device_id, fallback_bandwidth_gbps)
        per_dst_ms[move.dst_device_id] = per_dst_ms.get(move.dst_device_id, 0.0) + link.transfer_ms(move.num_bytes)
    return max(per_dst_ms.values(), default=0.0) / 1e3


def drain_time_s(inflight_requests: float, remaining_output_tokens: float, tpot_ms: float, *,
                 max_batch_requests: int | None = None) -> float:
    """Seconds for the old gear to finish its in-flight requests after admissions stop.

    With continuous batching the in-flight requests decode together, one token each per step, so a
    wave of up to ``max_batch_requests`` drains in ``remaining_output_tokens x tpot_ms``; more
    requests than one batch holds drain in ``ceil(inflight / max_batch_requests)`` waves.

    Args:
        inflight_requests: requests admitted and unfinished (``MetricSample.running``).
        remaining_output_tokens: output tokens each still has to generate (mean, or a percentile
            for a conservative estimate).
        tpot_ms: time per output token, ms (``MetricSample.tpot_p50_ms`` or the gear's estimate).
        max_batch_requests: requests decoded together; None = all in-flight requests at once.

    Raises:
        InputError: a negative or non-finite argument, or ``max_batch_requests`` < 1.
    """
    for name, value in (("inflight_requests", inflight_requests),
                        ("remaining_output_tokens", remaining_output_tokens), ("tpot_ms", tpot_ms)):
        if not (value >= 0 and math.isfinite(value)):
            raise InputError("drain_time_s", name, f"expected a finite value >= 0, got {value!r}")
    if inflight_requests == 0:
        return 0.0
    if max_batch_requests is not None and max_batch_requests < 1:
        raise InputError("drain_time_s", "max_batch_requests", f"expected >= 1, got {max_batch_requests}")
    waves = 1 if max_batch_requests is None else math.ceil(inflight_requests / max_batch_requests)
    return waves * remaining_output_tokens * tpot_ms / 1e3


def migration_cost_s(from_gear: Gear, to_gear: Gear, cluster: ClusterProfile,
                     layer_weight_bytes: Sequence[float], *, drain_s: float = 0.0,
                     embedding_bytes: float = 0.0, lm_head_bytes: float = 0.0,
                     fallback_bandwidth_gbps: float | None = None) -> float:
    """Design migration cost, seconds: weight transfer time (bytes moved / link bandwidth) + drain time.

    A shift to the same gear costs 0. See :func:`weight_transfer_s` and :func:`drain_time_s`.
    """
    if from_gear.gear_id == to_gear.gear_id:
        return 0.0
    return weight_transfer_s(from_gear, to_gear, cluster, layer_weight_bytes, embedding_bytes=embedding_bytes,
                             lm_head_bytes=lm_head_bytes, fallback_bandwidth_gbps=fallback_bandwidth_gbps) + drain_s


def migration_cost_fn(cluster: ClusterProfile, layer_weight_bytes: Sequence[float], *,
                      drain_s: float | Callable[[Gear], float] = 0.0, embedding_bytes: float = 0.0,
                      lm_head_bytes: float = 0.0, fallback_bandwidth_gbps: float | None = None
                      ) -> Callable[[Gear, Gear], float]:
    """A ``(from_gear, to_gear) -> seconds`` function for :meth:`Controller.decide`'s ``migration_cost_s``.

    Args:
        drain_s: seconds, or a function of the old gear giving them (e.g. from the newest sample's
            ``running`` and ``tpot_p50_ms`` via :func:`drain_time_s`).
    """
    weights = list(layer_weight_bytes)

    def cost(from_gear: Gear, to_gear: Gear) -> float:
        drain = drain_s(from_gear) if callable(drain_s) else drain_s
        return migration_cost_s(from_gear, to_gear, cluster, weights, drain_s=drain,
                                embedding_bytes=embedding_bytes, lm_head_bytes=lm_head_bytes,
                                fallback_bandwidth_gbps=fallback_bandwidth_gbps)

    return cost
