"""The pipeline on CUDA (``gpu`` marker): greedy output identical to ``transformers`` ``generate`` on
the same GPU (both fp32: ``auto`` would compute in bf16), for 1, 2 and 3 stages, even and uneven, batch 1 and
8, with decode steps replayed as CUDA graphs (the default); and those graphs captured and replayed in one
process, outputs unchanged. Stages take
``cuda:<stage mod GPU count>``; with a GPU per stage activations move over NCCL, with fewer GPUs
the stages share them and talk over gloo. Skips, saying so, without CUDA."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions, cuda_backend  # noqa: E402
from tests.test_runtime_helpers import MAX_NEW_TOKENS, checkpoint, gear, prompt_ids, requests  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")


@functools.lru_cache(maxsize=1)
def hf_reference_cuda() -> dict[str, list[int]]:
    """transformers greedy ``generate`` on ``cuda:0``, one prompt at a time: prompt index -> new tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint().path), dtype=torch.float32).to("cuda:0").eval()
    ref = {}
    with torch.inference_mode():
        for i, ids in enumerate(prompt_ids()):
            out = model.generate(torch.tensor([ids], device="cuda:0"), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            ref[str(i)] = out[0, len(ids):].tolist()
    del model
    torch.cuda.empty_cache()
    return ref


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("ranges", [[(0, 30)], [(0, 15), (15, 30)], [(0, 4), (4, 30)], [(0, 10), (10, 20), (20, 30)],
                                    [(0, 2), (2, 25), (25, 30)]],
                         ids=["1", "2-even", "2-uneven", "3-even", "3-uneven"])
@pytest.mark.parametrize("micro_batch_size", [8, 1])
def test_cuda_pipeline_matches_hf_generate(ranges, micro_batch_size):
    ref = hf_reference_cuda()
    reqs = requests(8 if micro_batch_size == 8 else 3, prefix=f"gpu{len(ranges)}{ranges[0][1]}{micro_batch_size}-")
    with PipelineRuntime(gear(ranges, micro_batch_size=micro_batch_size), checkpoint(),
                         RuntimeOptions(device="cuda", dtype="fp32", start_timeout_s=600)) as rt:
        outs = rt.generate(reqs)
    got = {o.request_id: o.output_token_ids for o in outs}
    assert got == {r.request_id: ref[r.request_id.split("-")[-1]] for r in reqs}, \
        f"backend {cuda_backend(len(ranges))}, {torch.cuda.device_count()} GPU(s)"


def test_cuda_backend_choice():
    assert cuda_backend(2, gpus=2) == "cpu:gloo,cuda:nccl"
    assert cuda_backend(3, gpus=1) == "gloo"


def _local_cuda(dtype: str, decode_graphs: str, devices: tuple[str, ...] = ("cuda:0", "cuda:0")):
    from flexpipe_dag.runtime.local import LocalPipeline
    from flexpipe_dag.runtime.model_loader import load_stage_module

    ranges = [(0, 10), (10, 30)]
    stages = [load_stage_module(checkpoint(), a, b, first=i == 0, last=i == len(ranges) - 1, dtype=dtype).to(dev)
              for i, ((a, b), dev) in enumerate(zip(ranges, devices))]
    return LocalPipeline(stages, num_blocks=128, block_size_tokens=16, decode_graphs=decode_graphs)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("micro_batch_size", [8, 3])
def test_decode_graphs_are_captured_once_per_shape_and_replayed_with_exact_outputs(micro_batch_size):
    pipe = _local_cuda("fp32", "auto")
    outs = pipe.generate(requests(), micro_batch_size=micro_batch_size)
    assert {o.request_id: o.output_token_ids for o in outs} == hf_reference_cuda()
    for graphs in pipe.graphs:
        assert graphs is not None and graphs.capture
        assert graphs.captures == len(graphs.buckets) > 0 and graphs.replays > 0 and graphs.eager_steps == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_replayed_graphs_compute_what_the_padded_path_computes_eagerly(dtype):
    """The same kernels on the same padded shapes: graphs and the eager padded path agree exactly in 16 bits
    (where a comparison with an fp32 reference could not be exact)."""
    if dtype == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    graphs = _local_cuda(dtype, "auto").generate(requests(), micro_batch_size=8)
    eager = _local_cuda(dtype, "eager").generate(requests(), micro_batch_size=8)
    assert {o.request_id: o.output_token_ids for o in graphs} == {o.request_id: o.output_token_ids for o in eager}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_decode_graphs_capture_on_a_stage_that_is_not_on_the_current_device():
    pipe = _local_cuda("fp32", "auto", devices=("cuda:0", "cuda:1"))  # the current device stays cuda:0
    outs = pipe.generate(requests(), micro_batch_size=8)
    assert {o.request_id: o.output_token_ids for o in outs} == hf_reference_cuda()
    assert all(g is not None and g.replays > 0 for g in pipe.graphs)
