"""Layer partitions: uniform, balanced by weight, and the exact min-bottleneck DP against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from flexpipe_dag.core.errors import InfeasibleError
from flexpipe_dag.planner.partition import (
    balanced_partition,
    compositions,
    min_bottleneck_split,
    uniform_partition,
)


def test_uniform_38_layers_into_8_stages_differ_by_at_most_one():
    sizes = uniform_partition(38, 8)
    assert sum(sizes) == 38 and len(sizes) == 8
    assert max(sizes) - min(sizes) <= 1


def test_uniform_42_into_16_has_no_empty_stage():
    sizes = uniform_partition(42, 16)
    assert sum(sizes) == 42 and min(sizes) >= 1


def test_more_stages_than_layers_is_a_clear_error():
    with pytest.raises(InfeasibleError, match="cannot split 20 layers into 24 stages"):
        uniform_partition(20, 24)
    with pytest.raises(InfeasibleError, match="20 layers"):
        balanced_partition([1.0] * 20, 24)
    with pytest.raises(InfeasibleError, match="24 stages"):
        min_bottleneck_split(np.zeros((24, 21, 21)))


def _equal_layer_costs(num_stages: int, num_layers: int) -> np.ndarray:
    i = np.arange(num_layers + 1)
    per = (i[None, :] - i[:, None]).astype(float)
    return np.broadcast_to(per, (num_stages, num_layers + 1, num_layers + 1)).copy()


def test_five_equal_layers_into_four_stages_is_2_1_1_1():
    bottleneck, sizes = min_bottleneck_split(_equal_layer_costs(4, 5))
    assert bottleneck == 2.0
    assert sorted(sizes, reverse=True) == [2, 1, 1, 1]


def test_dp_on_42_layers_16_stages_every_stage_non_empty():
    rng = np.random.default_rng(7)
    layer = rng.uniform(0.5, 2.0, size=42)
    prefix = np.concatenate([[0], np.cumsum(layer)])
    speed = rng.uniform(0.5, 3.0, size=16)
    costs = (prefix[None, None, :] - prefix[None, :, None]) / speed[:, None, None]
    bottleneck, sizes = min_bottleneck_split(costs)
    assert len(sizes) == 16 and sum(sizes) == 42 and min(sizes) >= 1


@pytest.mark.parametrize("seed", range(25))
def test_dp_equals_brute_force_on_random_costs(seed):
    rng = np.random.default_rng(seed)
    n_layers, n_stages = int(rng.integers(2, 9)), 0
    n_stages = int(rng.integers(1, n_layers + 1))
    costs = rng.uniform(0.1, 5.0, size=(n_stages, n_layers + 1, n_layers + 1))
    costs[rng.uniform(size=costs.shape) < 0.15] = np.inf          # some placements do not fit
    links = rng.uniform(0, 3, size=n_stages - 1).tolist()
    best = np.inf
    for sizes in compositions(n_layers, n_stages):
        start, worst = 0, 0.0
        for s, k in enumerate(sizes):
            worst = max(worst, costs[s, start, start + k])
            start += k
        best = min(best, worst)
    got, sizes = min_bottleneck_split(costs, links)
    if np.isinf(best):
        assert np.isinf(got) and sizes == []
    else:
        assert got == pytest.approx(max([best, *links]))
        assert sum(sizes) == n_layers and min(sizes) >= 1


@pytest.mark.parametrize("seed", range(15))
def test_balanced_partition_minimises_the_largest_part(seed):
    rng = np.random.default_rng(100 + seed)
    weights = rng.uniform(0, 10, size=int(rng.integers(3, 11))).tolist()
    parts = int(rng.integers(1, len(weights) + 1))
    sizes = balanced_partition(weights, parts)
    assert sum(sizes) == len(weights) and min(sizes) >= 1 and len(sizes) == parts

    def worst(sz):
        start, out = 0, 0.0
        for k in sz:
            out = max(out, sum(weights[start:start + k]))
            start += k
        return out

    assert worst(sizes) == pytest.approx(min(worst(c) for c in compositions(len(weights), parts)))
