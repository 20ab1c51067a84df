"""Roofline cost model: regimes, per-device overrides, the timing protocol, and the shipped calibration."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexpipe_dag.calibration.reference import efficiency_document, fit_efficiency
from flexpipe_dag.core.cluster import load_cluster_profile
from flexpipe_dag.core.errors import InputError
from flexpipe_dag.planner.cost_model import CostModel, Efficiency, default_efficiency
from flexpipe_dag.planner.gears import plan_gears
from flexpipe_dag.planner.model_spec import load_model_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"


@pytest.fixture(scope="module")
def lab():
    return load_cluster_profile(EXAMPLES / "fragmented_lab.yaml")


def test_decode_is_bandwidth_bound_and_prefill_compute_bound(lab):
    model = load_model_spec("Llama-2-7B")
    cm = CostModel(model, lab)
    dev = lab.device("host-a100-gpu0")
    gemm = default_efficiency()["gemm"]
    floor_ms = model.layer_weight_bytes() / (dev.hbm_bandwidth_gbps * 1e9 * gemm.memory) * 1e3
    one = cm.layer_decode_ms(dev.device_id, 1, 512)
    assert floor_ms <= one <= 1.5 * floor_ms                   # reading the weights dominates a 1-token step
    assert cm.layer_decode_ms(dev.device_id, 8, 8 * 512) < 2 * one  # batching amortises the weight reads
    big = cm.layer_prefill_ms(dev.device_id, 4096)
    flops = 4096 * model.prefill_flops_per_token(4096)
    assert big >= flops / (dev.peak_tflops * 1e12) * 1e3        # never faster than peak
    t4 = lab.device("host-t4-gpu0").device_id
    assert cm.layer_prefill_ms(t4, 4096) > 3 * big              # a T4 is several times slower


def test_device_overrides_change_only_that_device(lab):
    model = load_model_spec("Llama-3-8B")
    slow = {"gemm": Efficiency(compute=0.2, memory=0.3, overhead_us=10.0)}
    base = CostModel(model, lab)
    over = CostModel(model, lab, device_overrides={"host-a100-gpu0": slow})
    assert over.layer_decode_ms("host-a100-gpu0", 1, 100) > base.layer_decode_ms("host-a100-gpu0", 1, 100)
    assert over.layer_decode_ms("host-a100-gpu1", 1, 100) == base.layer_decode_ms("host-a100-gpu1", 1, 100)
    with pytest.raises(InputError, match="unknown device ids"):
        CostModel(model, lab, device_overrides={"nope": slow})


def test_timings_follow_the_gear(lab):
    model = load_model_spec("Llama-3-8B")
    gear = plan_gears(lab, model, concurrency=16)[1]
    timing = CostModel(model, lab).timings(gear)
    assert timing.num_stages == gear.num_stages
    last = gear.num_stages - 1
    assert timing.transfer_ms(last, 100) == 0.0
    for i in range(gear.num_stages):
        assert timing.decode_ms(i, 4, 4000) > 0 and timing.prefill_ms(i, 512) > timing.prefill_ms(i, 16)
    assert timing.decode_ms(0, gear.micro_batch_size, 1) <= timing.decode_ms(0, gear.micro_batch_size, 10**6)


def test_shipped_efficiency_file_matches_a_fresh_fit():
    fits = fit_efficiency()
    shipped = default_efficiency()
    doc = efficiency_document(fits)["op_classes"]
    for cls, row in doc.items():
        assert shipped[cls].compute == pytest.approx(row["compute"], abs=1e-3)
        assert shipped[cls].memory == pytest.approx(row["memory"], abs=1e-3)
    assert fits["gemm"].mape < 0.15                             # GEMMs dominate stage time
