"""Migration cost between gears: weight bytes that move, their transfer time over cluster links, drain."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexpipe_dag.control import (
    bytes_to_move,
    drain_time_s,
    layer_moves,
    migration_cost_fn,
    migration_cost_s,
    weight_transfer_s,
)
from flexpipe_dag.core.cluster import load_cluster_profile, parse_cluster_profile
from flexpipe_dag.core.errors import InfeasibleError, InputError
from flexpipe_dag.core.gear import Gear, StagePlan

CLUSTER = load_cluster_profile(Path(__file__).resolve().parents[1] / "examples/clusters/fragmented_lab.yaml")
A0, A1, T0 = "host-a100-gpu0", "host-a100-gpu1", "host-t4-gpu0"
LAYER_BYTES = [100e6] * 30  # 100 MB per decoder layer


def gear(gear_id: str, *stages: tuple[int, int, list[str]]) -> Gear:
    return Gear(gear_id=gear_id, kind="manual", model_name="m", num_layers=30,
                stages=[StagePlan(stage_index=i, layer_start=a, layer_end=b, device_ids=d)
                        for i, (a, b, d) in enumerate(stages)])


TWO = gear("two", (0, 15, [A0]), (15, 30, [A1]))
THREE = gear("three", (0, 10, [A0]), (10, 20, [A1]), (20, 30, [T0]))


def test_layers_whose_device_changes_move():
    moves = layer_moves(TWO, THREE, LAYER_BYTES, lm_head_bytes=50e6)
    to_a1 = [m.layer for m in moves if m.dst_device_id == A1]
    to_t4 = [m.layer for m in moves if m.dst_device_id == T0]
    assert to_a1 == list(range(10, 15)) and all(m.src_device_id == A0 for m in moves if m.dst_device_id == A1)
    assert to_t4 == list(range(20, 30)) + [30]  # 30 = final norm + LM head, charged to the last stage
    assert bytes_to_move(TWO, THREE, LAYER_BYTES, lm_head_bytes=50e6) == 15 * 100e6 + 50e6
    # back: A0 gets 10..14 again, A1 gets 20..29 (from the T4); 0..9 and 15..19 never moved
    back = layer_moves(THREE, TWO, LAYER_BYTES)
    assert [(m.layer, m.dst_device_id) for m in back] == [(i, A0) for i in range(10, 15)] + [(i, A1) for i in range(20, 30)]


def test_replicas_each_receive_a_copy_and_embedding_follows_the_first_stage():
    rep = gear("rep", (0, 15, [A0, T0]), (15, 30, [A1]))
    moves = layer_moves(TWO, rep, LAYER_BYTES, embedding_bytes=30e6)
    assert [m.layer for m in moves] == [-1] + list(range(15))
    assert {m.dst_device_id for m in moves} == {T0}


def test_transfer_time_uses_the_fastest_link_and_serialises_per_destination():
    t_s = weight_transfer_s(TWO, THREE, CLUSTER, LAYER_BYTES)
    nvlink = CLUSTER.link(A0, A1)
    net = CLUSTER.link(A1, T0)
    to_a1_ms = 5 * nvlink.transfer_ms(100e6)
    to_t4_ms = 10 * net.transfer_ms(100e6)  # layers 20..29 come from A1 (A0 has none of them)
    assert t_s == pytest.approx(max(to_a1_ms, to_t4_ms) / 1e3)
    assert t_s == pytest.approx(10 * 100e6 / 12.5e9 + 10 * 25e-6)  # 100 GbE dominates: 80 ms
    assert migration_cost_s(TWO, THREE, CLUSTER, LAYER_BYTES, drain_s=1.5) == pytest.approx(t_s + 1.5)
    assert migration_cost_s(TWO, TWO, CLUSTER, LAYER_BYTES, drain_s=1.5) == 0.0


def test_missing_link_needs_a_fallback_bandwidth():
    bare = parse_cluster_profile({"cluster_id": "bare", "devices": [d.model_dump() for d in CLUSTER.devices]})
    with pytest.raises(InfeasibleError, match="no link from any of"):
        weight_transfer_s(TWO, THREE, bare, LAYER_BYTES)
    t_s = weight_transfer_s(TWO, THREE, bare, LAYER_BYTES, fallback_bandwidth_gbps=2.0)
    assert t_s == pytest.approx(10 * 100e6 / 2e9)


def test_drain_time():
    assert drain_time_s(8, 100, 20.0) == pytest.approx(2.0)  # one continuous batch
    assert drain_time_s(8, 100, 20.0, max_batch_requests=4) == pytest.approx(4.0)  # two waves
    assert drain_time_s(0, 100, 20.0) == 0.0
    with pytest.raises(InputError, match="tpot_ms"):
        drain_time_s(1, 10, -1.0)


def test_cost_function_for_the_controller():
    fn = migration_cost_fn(CLUSTER, LAYER_BYTES, drain_s=lambda old: 2.0 if old.gear_id == "two" else 0.0)
    assert fn(TWO, THREE) == pytest.approx(weight_transfer_s(TWO, THREE, CLUSTER, LAYER_BYTES) + 2.0)
    assert fn(THREE, TWO) == pytest.approx(weight_transfer_s(THREE, TWO, CLUSTER, LAYER_BYTES))


def test_bad_weights_are_input_errors():
    with pytest.raises(InputError, match="expected 30 entries"):
        bytes_to_move(TWO, THREE, [1.0] * 29)
    with pytest.raises(InputError, match=r"layer_weight_bytes\[3\]"):
        bytes_to_move(TWO, THREE, [1.0] * 3 + [-1.0] + [1.0] * 26)
    other = Gear(gear_id="x", kind="manual", model_name="m", num_layers=10,
                 stages=[StagePlan(stage_index=0, layer_start=0, layer_end=10, device_ids=[A0])])
    with pytest.raises(InputError, match="keeps the model"):
        bytes_to_move(TWO, other, LAYER_BYTES)
