"""Half precision: the planner's memory figures equal what the runtime allocates, per dtype; ``auto``
picks fp32 on a CPU and the GPU's 16-bit format on a GPU; a 16-bit pipeline runs and agrees with fp32."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from flexpipe_dag.core.errors import InputError
from flexpipe_dag.core.gear_builders import even_gear
from flexpipe_dag.planner.model_spec import load_model_spec
from flexpipe_dag.runtime.local import LocalPipeline
from flexpipe_dag.runtime.model_loader import head_dtype, load_stage_module, memory_dtype, resolve_dtype
from flexpipe_dag.runtime.pipeline import kv_num_blocks, stage_memory_bytes
from tests.test_runtime_helpers import checkpoint, requests

SPLIT = [(0, 10), (10, 20), (20, 30)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_planner_and_runtime_agree_on_weight_and_kv_bytes(dtype):
    ck = checkpoint()
    spec = load_model_spec(ck.path)
    gear = even_gear(ck.num_layers, 3, ck.name, 4, None, 1024)
    figures = stage_memory_bytes(gear, ck, dtype)
    blocks = kv_num_blocks(gear)
    for i, (a, b) in enumerate(SPLIT):
        first, last = i == 0, i == len(SPLIT) - 1
        module = load_stage_module(ck, a, b, first=first, last=last, dtype=dtype)
        pool = module.new_kv_pool(blocks, gear.kv_block_size_tokens)
        planned_weights = ((b - a) * spec.layer_weight_bytes(dtype) + (spec.first_stage_extra_bytes(dtype) if first else 0)
                           + (spec.last_stage_extra_bytes(dtype) if last else 0))
        planned_kv = pool.capacity_tokens * (b - a) * spec.kv_bytes_per_token_per_layer(dtype)
        assert module.param_bytes() == planned_weights == figures[i]["param_bytes"], (dtype, i)
        assert pool.nbytes == planned_kv == figures[i]["kv_pool_bytes"], (dtype, i)
        assert next(module.parameters()).dtype == pool.k.dtype


def test_auto_is_fp32_on_a_cpu_and_16_bit_memory_on_a_gpu():
    assert resolve_dtype("auto", "cpu") == head_dtype("auto", "cpu") == "fp32"
    assert resolve_dtype("float16", "cpu") == "fp16" and resolve_dtype("bf16", "cpu") == "bf16"
    assert memory_dtype("auto", "cpu") == "fp32" and memory_dtype("auto", "cuda") == "bf16"
    with pytest.raises(InputError, match="weight-only"):
        resolve_dtype("int8", "cpu")
    with pytest.raises(InputError, match="unknown|expected one of"):
        head_dtype("fp8", "cpu")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_16_bit_pipeline_generates_and_mostly_agrees_with_fp32(dtype):
    """CPU runs 16-bit too (slowly); greedy tokens may part from fp32 after a near tie, so the check is
    that most first tokens agree, not exact equality (that is fp32's test)."""
    reqs = requests()
    outs = {}
    for dt in ("fp32", dtype):
        pipe = LocalPipeline.from_layer_ranges(checkpoint(), [(0, 15), (15, 30)], num_blocks=64, block_size_tokens=16,
                                               dtype=dt)
        outs[dt] = {o.request_id: o.output_token_ids for o in pipe.generate(reqs, micro_batch_size=4)}
    same_first = sum(outs["fp32"][r.request_id][:1] == outs[dtype][r.request_id][:1] for r in reqs)
    assert all(len(outs[dtype][r.request_id]) >= 1 for r in reqs)
    assert same_first >= len(reqs) - 1, outs


@pytest.mark.parametrize("command", ["serve", "run"])
def test_device_cuda_without_a_visible_gpu_is_one_line_naming_the_flag(command, tmp_path):
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here: the refusal is for hosts without one")
    extra = ["--no-store"] if command == "serve" else ["--trace", "azure-conv", "--out", str(tmp_path / "out.jsonl")]
    proc = subprocess.run([sys.executable, "-m", "flexpipe_dag.cli", command, "--stages", "2", "--device", "cuda",
                           *extra], capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                                   "FLEXPIPE_HOME": str(tmp_path)})
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (f"flexpipe {command}: error: --device: cuda: no CUDA device "
                                                    "visible to torch on this host"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
