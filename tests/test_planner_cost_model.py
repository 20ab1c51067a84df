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


def test_a_micro_batch_of_prompts_attends_within_each_prompt(lab):
    """8 prompts of 2,000 tokens score 8 x 2,000 x 2,001 / 2 query-key pairs, not those of one 16,000-token
    prompt (64x fewer pairs): the simulator passes the prompts of each iteration, the gear timing prices them
    as the cost model does, and the last stage computes one logit row per prompt."""
    model = load_model_spec("Llama-3-8B")
    gear = plan_gears(lab, model, concurrency=16)[1]
    cm = CostModel(model, lab)
    timing = cm.timings(gear)
    for i, st in enumerate(gear.stages):
        first, last = i == 0, i == gear.num_stages - 1
        assert timing.prefill_ms(i, 16_000, 8) == cm.stage_prefill_ms(st.device_ids[0], st.num_layers, first, last, 16_000, 8)
        assert timing.prefill_ms(i, 16_000, 8) < 0.9 * timing.prefill_ms(i, 16_000)  # one prompt: quadratic attention
        assert timing.prefill_ms(i, 16_000) == timing.prefill_ms(i, 16_000, 1)


def test_shipped_efficiency_file_matches_a_fresh_fit():
    fits = fit_efficiency()
    shipped = default_efficiency()
    doc = efficiency_document(fits)["op_classes"]
    for cls, row in doc.items():
        assert shipped[cls].compute == pytest.approx(row["compute"], abs=1e-3)
        assert shipped[cls].memory == pytest.approx(row["memory"], abs=1e-3)
    assert fits["gemm"].mape < 0.15                             # GEMMs dominate stage time


def test_a_step_prices_decode_only_and_one_prompt_as_the_dedicated_methods(lab):
    model = load_model_spec("Llama-3-8B")
    cm = CostModel(model, lab)
    dev = lab.devices[0].device_id
    for first, last in ((True, False), (False, True), (True, True)):
        assert cm.stage_step_ms(dev, 8, first, last, 0, 0, 16, 16 * 900) == pytest.approx(
            cm.stage_decode_ms(dev, 8, first, last, 16, 16 * 900), rel=1e-12)
        assert cm.stage_step_ms(dev, 8, first, last, 700, 1, 0, 0) == pytest.approx(
            cm.stage_prefill_ms(dev, 8, first, last, 700), rel=1e-12)


def test_a_single_prompt_prefill_is_exactly_a_one_prompt_step_and_its_layer_pieces(lab):
    """stage_prefill_ms of one prompt equals, bit for bit, stage_step_ms of that prompt alone and the sum of its
    pieces (layers of layer_prefill_ms, the embedding, one logit row) on every device type of the lab, with and
    without a calibration override, for any layer count, prompt length and stage position."""
    model = load_model_spec("Llama-3-8B")
    slow = {"attention": Efficiency(compute=0.3, memory=0.4, overhead_us=7.0)}
    devices = sorted({d.device_id for d in lab.devices}, key=lambda d: CostModel(model, lab).device_key(d))
    for cm in (CostModel(model, lab), CostModel(model, lab, device_overrides={devices[0]: slow})):
        for dev in devices:
            for layers in (1, 8, 32):
                for tokens in (1, 2, 17, 700, 4096, 16_000):
                    for first in (False, True):
                        for last in (False, True):
                            pieces = layers * cm.layer_prefill_ms(dev, tokens)
                            if first:
                                pieces += cm.first_extra_ms(dev, tokens)
                            if last:
                                pieces += cm.last_extra_ms(dev, 1)
                            for prompts in (1, 0):
                                assert cm.stage_prefill_ms(dev, layers, first, last, tokens, prompts) == pieces
                            assert cm.stage_step_ms(dev, layers, first, last, tokens, 1, 0, 0) == pieces
