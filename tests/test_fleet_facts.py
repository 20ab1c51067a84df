"""Fleet facts (issue 13, items 5-8): seed peer ids, datasheet figures by generation, usable memory,
per-device dtype support, memory bandwidth as a first-class figure, and the catalog's sources."""

from __future__ import annotations

import logging

import pytest

from flexpipe_dag.core.catalog import gpu_catalog, lookup_gpu
from flexpipe_dag.core.cluster import (
    CUDA_CONTEXT_RESERVE_GIB,
    ClusterProfile,
    Device,
    choose_gear_dtype,
    parse_cluster_profile,
)
from flexpipe_dag.core.errors import InfeasibleError, InputError
from flexpipe_dag.planner.cost_model import CostModel
from flexpipe_dag.planner.gears import make_search, plan_gears
from flexpipe_dag.planner.model_spec import GIB, load_model_spec
from flexpipe_dag.planner.workload import PlanWorkload
from flexpipe_dag.profiling.probe import merge_profiles

LINK = {"bandwidth_gbps": 12.5, "latency_us": 25}


def _seed(*nodes: dict) -> dict:
    return {"cluster_id": "seed", "nodes": list(nodes)}


# -- item 5: the design's seed example ------------------------------------------------------------
def test_seed_key_to_gpu_002_names_node_gpu_002_written_with_a_dash():
    p = parse_cluster_profile(_seed(
        {"node_id": "gpu-001", "generation": "A100", "memory_gb": 80, "compute_score": 1.0,
         "interconnect": {"to_gpu_002": LINK}},
        {"node_id": "gpu-002", "generation": "A100", "memory_gb": 80, "compute_score": 1.0,
         "interconnect": {"to_gpu-001": LINK}},
    ), "seed.yaml")
    assert p.link("gpu-001", "gpu-002").bandwidth_gbps == 12.5
    assert p.link("gpu-002", "gpu-001") is not None


def test_seed_key_matching_two_nodes_is_an_error_naming_both():
    doc = _seed(
        {"node_id": "gpu-a_1", "generation": "T4", "memory_gb": 16},
        {"node_id": "gpu_a-1", "generation": "T4", "memory_gb": 16},
        {"node_id": "gpu-b", "generation": "T4", "memory_gb": 16, "interconnect": {"to_gpu_a_1": LINK}},
    )
    with pytest.raises(InputError) as err:
        parse_cluster_profile(doc, "seed.yaml")
    text = str(err.value)
    assert "seed.yaml" in text and "nodes[2].interconnect.to_gpu_a_1" in text
    assert "'gpu-a_1'" in text and "'gpu_a-1'" in text


def test_seed_key_matching_one_node_exactly_and_another_with_a_dash_is_still_ambiguous():
    # to_gpu_2 spells node gpu_2 exactly, and gpu-2 with '_' for '-': the exact spelling does not win silently
    doc = _seed(
        {"node_id": "gpu_2", "generation": "T4", "memory_gb": 16},
        {"node_id": "gpu-2", "generation": "T4", "memory_gb": 16},
        {"node_id": "gpu-b", "generation": "T4", "memory_gb": 16, "interconnect": {"to_gpu_2": LINK}},
    )
    with pytest.raises(InputError, match=r"nodes\[2\]\.interconnect\.to_gpu_2.*ambiguous.*'gpu_2'.*'gpu-2'"):
        parse_cluster_profile(doc, "seed.yaml")


def test_seed_node_without_compute_score_takes_the_t4_datasheet():
    p = parse_cluster_profile(_seed({"node_id": "gpu-003", "generation": "T4", "memory_gb": 16}), "seed.yaml")
    t4 = p.device("gpu-003")
    spec = gpu_catalog()["T4"]
    assert (t4.model_name, t4.peak_tflops, t4.hbm_bandwidth_gbps) == ("T4", 65.0, 320.0)
    assert t4.compute_score == pytest.approx(65.0 / 312.0)
    assert t4.memory_gib == spec.memory_gib == pytest.approx(15.0)  # 15360 MiB reported, not the 16 GB label
    assert t4.bf16 is False


def test_seed_node_of_unknown_generation_without_compute_score_is_refused_by_field():
    with pytest.raises(InputError) as err:
        parse_cluster_profile(_seed({"node_id": "g0", "generation": "Z9000", "memory_gb": 32}), "fleet.yaml")
    text = str(err.value)
    assert "fleet.yaml" in text and "nodes[0].generation" in text and "'Z9000'" in text
    assert "compute_score" in text and "T4" in text and "A40" in text  # the known generations are listed


# -- item 8: memory bandwidth is a first-class figure ---------------------------------------------
def test_a40_declared_with_compute_score_only_gets_its_datasheet_bandwidth():
    p = parse_cluster_profile(_seed({"node_id": "a40", "generation": "A40", "memory_gb": 48, "compute_score": 0.48}))
    a40 = p.device("a40")
    assert a40.hbm_bandwidth_gbps == 696.0  # datasheet, not 2039 x 0.48 = 978 derived from compute
    assert a40.peak_tflops == pytest.approx(0.48 * 312)  # the declared compute stays
    assert not p.notes


def test_unknown_gpu_with_compute_score_only_gets_a_derived_bandwidth_and_a_note():
    p = parse_cluster_profile(_seed({"node_id": "x", "generation": "Z9000", "memory_gb": 32, "compute_score": 0.5}))
    assert p.device("x").hbm_bandwidth_gbps == pytest.approx(2039 * 0.5)
    assert any("hbm_bandwidth_gbps derived from compute_score" in n and "x" in n for n in p.notes)
    assert any("memory_gb 32" in n for n in p.notes)  # memory derived from the label, said too


def test_unnamed_gpu_note_does_not_call_it_gpu_none():
    # a seed node with compute_score but neither generation nor model_name was noted as "GPU None not in the catalog"
    p = parse_cluster_profile(_seed({"node_id": "x", "memory_gb": 32, "compute_score": 0.5}))
    note = next(n for n in p.notes if "hbm_bandwidth_gbps derived from compute_score" in n)
    assert "None" not in note and "no generation or model_name given" in note


def test_memory_bound_operators_are_priced_with_the_device_bandwidth():
    model = load_model_spec("Llama-3-8B")
    fast = Device(device_id="fast", node_id="h", memory_gib=40, peak_tflops=150, hbm_bandwidth_gbps=1392,
                  compute_score=150 / 312)
    slow = fast.model_copy(update={"device_id": "slow", "hbm_bandwidth_gbps": 696})
    cm = CostModel(model, ClusterProfile(cluster_id="c", devices=[fast, slow]), dtype="fp16")
    # an embedding lookup (8192 tokens) and a decode step are memory-bound: half the bandwidth, ~twice the time
    assert cm.first_extra_ms("slow", 8192) == pytest.approx(2 * cm.first_extra_ms("fast", 8192), rel=0.1)
    assert cm.layer_decode_ms("slow", 8, 8 * 1024) == pytest.approx(2 * cm.layer_decode_ms("fast", 8, 8 * 1024), rel=0.1)


def test_catalog_has_the_added_models_with_datasheet_sources():
    cat = gpu_catalog()
    a40 = cat["A40"]
    assert (a40.memory_label_gb, a40.hbm_bandwidth_gbps, a40.peak_tflops) == (48.0, 696.0, 149.7)
    for name in ("A100-PCIe-40GB", "A100-PCIe-80GB", "V100-PCIe-16GB", "V100-PCIe-32GB", "L40S", "L4", "RTX-A6000"):
        assert name in cat
    assert all(spec.source and spec.memory_visible_source for spec in cat.values())
    assert not cat["V100-PCIe-16GB"].bf16 and cat["L40S"].bf16
    assert lookup_gpu("NVIDIA A100-PCIE-40GB", 39.6).model_name == "A100-PCIe-40GB"  # the NVML name
    assert lookup_gpu("NVIDIA A40").model_name == "A40"


# -- item 6: memory is what the device reports, less the runtime's context -------------------------
def test_catalog_memory_is_driver_visible_gib_not_the_label():
    cat = gpu_catalog()
    assert cat["T4"].memory_gib == pytest.approx(15.0)
    assert cat["A10"].memory_gib == pytest.approx(22.49, abs=0.01)
    assert cat["V100-SXM2-16GB"].memory_gib == pytest.approx(15.78, abs=0.01)
    assert all(spec.memory_gib <= spec.memory_label_gb for spec in cat.values())


def test_t4_plans_into_its_reported_memory_less_the_context_reserve():
    cluster = parse_cluster_profile({"cluster_id": "t4", "fleet": [{"node_id": "h", "gpu_model": "T4", "count": 1}]})
    t4 = cluster.devices[0]
    assert t4.usable_memory_gib(0.12) == pytest.approx((15.0 - CUDA_CONTEXT_RESERVE_GIB) * 0.88)
    model = load_model_spec("Mistral-7B")  # 13.5 GiB of fp16 weights: under 16 x 0.88, over (15 - 0.5) x 0.88
    workload = PlanWorkload(context_p95_tokens=256, concurrency=1)
    search = make_search(cluster, model, dtype="fp16", workload=workload)
    assert search.tables(t4.device_id, 1).usable_bytes <= (15.0 - CUDA_CONTEXT_RESERVE_GIB) * GIB
    with pytest.raises(InfeasibleError, match="13.5 GiB of weights .* 12.8 GiB usable after the CUDA context"):
        plan_gears(cluster, model, dtype="fp16", workload=workload)


def test_cpu_workers_keep_no_cuda_context_reserve():
    d = Device(device_id="c", node_id="h", kind="cpu-worker", memory_gib=4, peak_tflops=0.1, hbm_bandwidth_gbps=10,
               compute_score=0.1 / 312)
    assert d.usable_memory_gib(0.10) == pytest.approx(3.6)


def test_a_profiled_gpu_keeps_its_measured_memory_and_bf16_support():
    declared = parse_cluster_profile({"cluster_id": "c", "fleet": [{"node_id": "h", "gpu_model": "A100-SXM-80GB"}]})
    d = declared.devices[0]
    measured = ClusterProfile(cluster_id="c", source="probe", devices=[d.model_copy(update={
        "kind": "cuda", "memory_gib": 79.15, "bf16": True, "peak_tflops": 280.0})])
    merged = merge_profiles(declared, measured).device(d.device_id)
    assert (merged.memory_gib, merged.peak_tflops, merged.bf16) == (79.15, 280.0, True)


# -- item 7: bf16 on devices without it ------------------------------------------------------------
def _v100_fleet() -> ClusterProfile:
    return parse_cluster_profile({"cluster_id": "mixed", "fleet": [
        {"node_id": "a", "gpu_model": "A100-SXM-80GB", "count": 1},
        {"node_id": "v", "gpu_model": "V100-SXM2-32GB", "count": 2}]})


def test_bf16_on_a_v100_fleet_is_planned_fp16_with_a_note(caplog):
    cluster, model = _v100_fleet(), load_model_spec("SmolLM2-135M")
    with caplog.at_level(logging.INFO, logger="flexpipe_dag.planner.gears"):
        search = make_search(cluster, model, dtype="bf16")
        gears = plan_gears(cluster, model, dtype="bf16")
    assert search.cm.dtype == "fp16"
    # a gear using a V100 runs in fp16 on all its devices; one on the A100 alone stays bf16
    for g in gears:
        devices = {d for st in g.stages for d in st.device_ids}
        assert g.dtype == ("bf16" if devices == {"a-gpu0"} else "fp16"), (g.gear_id, devices, g.dtype)
    assert any("v-gpu0 (V100-SXM2-32GB)" in n and "fp16" in n for n in search.notes)
    assert "v-gpu1 (V100-SXM2-32GB)" in caplog.text and "runs in fp16" in caplog.text


def test_fp16_fallback_keeps_bf16_for_a_gear_on_bf16_devices_only():
    from flexpipe_dag.planner.gears import candidate_gears, gear_plan_dtype
    from flexpipe_dag.planner.search import PipelinePlan

    cluster, model = _v100_fleet(), load_model_spec("SmolLM2-135M")
    search = make_search(cluster, model, dtype="bf16")
    n = model.num_layers
    on_a100 = PipelinePlan(micro_batch_size=8, device_ids=[["a-gpu0"]], sizes=[n], stage_busy_ms=[1.0], link_busy_ms=[])
    mixed = PipelinePlan(micro_batch_size=8, device_ids=[["a-gpu0"], ["v-gpu0"]], sizes=[n // 2, n - n // 2],
                         stage_busy_ms=[1.0, 1.0], link_busy_ms=[0.1])
    assert (gear_plan_dtype(search, on_a100), gear_plan_dtype(search, mixed)) == ("bf16", "fp16")
    # and the same plan's timings do not depend on the label: bf16 and fp16 are both 2 bytes at one rate
    assert CostModel(model, cluster, dtype="bf16").stage_decode_ms("a-gpu0", n, True, True, 8, 512) == \
        CostModel(model, cluster, dtype="fp16").stage_decode_ms("a-gpu0", n, True, True, 8, 512)
    assert {g.dtype for g in candidate_gears(cluster, model, dtype="fp16")} == {"fp16"}  # fp16 asked: fp16 everywhere


def test_bf16_on_a_v100_fleet_refused_or_excluded_by_setting():
    cluster, model = _v100_fleet(), load_model_spec("SmolLM2-135M")
    with pytest.raises(InputError, match=r"bf16 is not supported on 2 device\(s\): v-gpu0 .*v-gpu1 .*dtype fp16"):
        plan_gears(cluster, model, dtype="bf16", workload=PlanWorkload(bf16_fallback="refuse"))
    search = make_search(cluster, model, dtype="bf16", workload=PlanWorkload(bf16_fallback="exclude"))
    assert search.cm.dtype == "bf16" and [d.device_id for d in search.pool] == ["a-gpu0"]
    assert search.excluded_for_dtype == ["v-gpu0", "v-gpu1"] and "left out 2 device(s)" in search.notes[0]
    gears = plan_gears(cluster, model, dtype="bf16", workload=PlanWorkload(bf16_fallback="exclude"))
    assert all(set(d for s in g.stages for d in s.device_ids) == {"a-gpu0"} for g in gears)


def test_dtype_choice_leaves_fp16_and_bf16_capable_fleets_alone():
    cluster = _v100_fleet()
    assert choose_gear_dtype(cluster.devices, "fp16").note is None
    assert choose_gear_dtype(cluster.devices[:1], "bf16").dtype == "bf16"
    with pytest.raises(InputError, match="bf16_fallback"):
        PlanWorkload(bf16_fallback="maybe")  # type: ignore[arg-type]
