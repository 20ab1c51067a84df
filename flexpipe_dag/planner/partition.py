"""Contiguous layer partitions: uniform, balanced by weight, and the exact min-bottleneck DP.

All functions take plain numbers and return layer counts per stage (``sizes``, summing to the
number of layers, every entry >= 1). A request for more stages than layers raises
:class:`~flexpipe_dag.core.errors.InfeasibleError` instead of producing an empty stage.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from flexpipe_dag.core.errors import InfeasibleError
from flexpipe_dag.core.gear_builders import even_layer_counts


def check_stage_count(num_layers: int, num_stages: int) -> None:
    """Raise :class:`InfeasibleError` unless ``1 <= num_stages <= num_layers``."""
    if num_stages < 1:
        raise InfeasibleError(f"need at least one stage, got {num_stages}")
    if num_stages > num_layers:
        raise InfeasibleError(f"cannot split {num_layers} layers into {num_stages} stages: "
                              f"at most {num_layers} stages (one layer each), no stage may be empty")


def uniform_partition(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts that differ by at most 1 (the first ``num_layers % num_stages`` stages get one more).

    Raises:
        InfeasibleError: ``num_stages > num_layers`` or ``num_stages < 1``.
    """
    check_stage_count(num_layers, num_stages)
    return even_layer_counts(num_layers, num_stages)


def sizes_to_bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[3, 2]`` -> ``[(0, 3), (3, 5)]`` (end exclusive)."""
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


def balanced_partition(weights: Sequence[float], num_stages: int) -> list[int]:
    """Split ``weights`` (one per layer, >= 0) into ``num_stages`` contiguous non-empty parts
    minimising the largest part sum.

    The objective of DeepSpeed's ``runtime.utils.partition_balanced`` (used for
    ``partition_method="parameters"``); solved exactly here by a binary search over candidate part
    sums with a greedy probe (each part as long as possible, leaving one layer per remaining part).

    Raises:
        InfeasibleError: more stages than layers.
    """
    n = len(weights)
    check_stage_count(n, num_stages)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=float))])
    candidates = sorted({float(prefix[j] - prefix[i]) for i in range(n) for j in range(i + 1, n + 1)})

    def probe(limit: float) -> list[int] | None:
        sizes, start = [], 0
        for part in range(num_stages):
            remaining_parts = num_stages - part - 1
            max_end = n - remaining_parts
            end = start + 1
            if prefix[end] - prefix[start] > limit + 1e-12:
                return None
            while end < max_end and prefix[end + 1] - prefix[start] <= limit + 1e-12:
                end += 1
            sizes.append(end - start)
            start = end
        return sizes if start == n else None

    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if probe(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    sizes = probe(candidates[lo])
    assert sizes is not None
    return sizes


def min_bottleneck_split(stage_costs: np.ndarray, link_costs: Sequence[float] | None = None) -> tuple[float, list[int]]:
    """Exact min-bottleneck split of ``L`` layers over an ordered list of ``S`` stages (Alpa-style DP).

    Args:
        stage_costs: shape ``(S, L + 1, L + 1)``; ``stage_costs[s, i, j]`` is the cost of stage ``s``
            running layers ``[i, j)`` (``inf`` where infeasible, e.g. out of memory). Entries with
            ``j <= i`` are ignored (no empty stage).
        link_costs: ``S - 1`` costs of the links between adjacent stages (also bound the bottleneck).

    Returns:
        ``(bottleneck, sizes)`` with ``max(stage costs, link costs) == bottleneck``; ``inf`` and ``[]``
        when no split is feasible.

    Recurrence: ``f[s][j] = min_{i<j} max(f[s-1][i], c[s][i][j])``, ``f[-1][0] = 0``; O(S L^2).

    Raises:
        InfeasibleError: more stages than layers.
    """
    costs = np.asarray(stage_costs, dtype=float)
    num_stages, n1, _ = costs.shape
    num_layers = n1 - 1
    check_stage_count(num_layers, num_stages)
    mask = np.tril(np.ones((n1, n1), dtype=bool))            # i >= j: empty or reversed
    f = np.full(n1, np.inf)
    f[0] = 0.0
    arg = np.zeros((num_stages, n1), dtype=int)
    for s in range(num_stages):
        c = np.where(mask, np.inf, costs[s])                  # (i, j)
        cand = np.maximum(f[:, None], c)                      # (i, j)
        arg[s] = np.argmin(cand, axis=0)
        f = cand[arg[s], np.arange(n1)]
    best = float(f[num_layers])
    links = max(link_costs) if link_costs is not None and len(link_costs) else 0.0
    if not np.isfinite(best):
        return float("inf"), []
    sizes, j = [], num_layers
    for s in range(num_stages - 1, -1, -1):
        i = int(arg[s, j])
        sizes.append(j - i)
        j = i
    return max(best, float(links)), sizes[::-1]


def compositions(num_layers: int, num_stages: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``num_layers`` as ``num_stages`` positive sizes (for exhaustive checks)."""
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def count_at_most(sorted_values: Sequence[float], limit: float) -> int:
    """How many of the ascending ``sorted_values`` are ``<= limit`` (a capacity at bottleneck ``limit``)."""
    return bisect.bisect_right(sorted_values, limit)
