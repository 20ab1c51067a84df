"""Output tokens/s of the multi-process pipeline (2 and 3 stages) vs single-process transformers.

Workload: the first N requests of the Azure conv trace (bundled slice), prompt lengths capped at
--max-prompt-tokens and outputs at --max-new-tokens, prompt text cut from the bundled corpus; EOS
is ignored (every request produces exactly its max_new_tokens) so every configuration produces
the same number of tokens. Baselines measured in the same run:

* ``hf_generate``: ``transformers`` ``generate`` (greedy, KV cache), batches of --batch-size with
  left padding, one process using all --baseline-threads threads;
* ``local_1stage``: FlexPipe's own stage code and scheduler in one process (no communication).

Pipelines: one process per stage + a driver, 1 thread each, gloo over loopback. Start-up (model
load) is excluded from every figure. Ratios are against ``hf_generate``.

With ``--score``: also the prefill-only scoring path (log-prob of every prompt token) on DeepSpeed's
PipelineModule with the 2-stage even gear, against a single-process ``transformers`` forward over
the same right-padded batches; prints rank start-up seconds (JIT compile included on a cold host)
and real prompt tokens/s of each, as a ratio.

With ``--device cuda`` every configuration runs on GPUs: the baseline and ``local_1stage`` on
``cuda:0``, pipeline stage ``s`` on ``cuda:<s mod GPU count>`` (NCCL between stages when each has a
GPU of its own, gloo through host memory when they share); synchronised timings.

Usage: OMP_NUM_THREADS=1 python bench/runtime_bench.py [--num-requests 32] [--max-new-tokens 16] [--score]
       [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TRACE = Path(__file__).resolve().parent.parent / "flexpipe_dag" / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--batch-size", dest="micro_batch_size", type=int, default=8,
                    help="sequences per micro-batch of the FlexPipe gears (and rows per transformers generate "
                         "batch of the baseline, so both batch alike)")
    ap.add_argument("--baseline-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--score", action="store_true", help="also bench the DeepSpeed scoring path")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--no-fidelity", action="store_true",
                    help="skip the simulator-vs-measured TTFT / TPOT comparison (bench/fidelity_bench.py)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from flexpipe_dag.core.gear_builders import even_gear
    from flexpipe_dag.runtime.batch import prompts_from_trace
    from flexpipe_dag.runtime.local import LocalPipeline
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions, cuda_backend
    from flexpipe_dag.runtime.scheduler import Request

    ckpt = resolve_checkpoint()
    tok = ckpt.tokenizer()
    rows = prompts_from_trace(args.trace, tok, num_requests=args.num_requests, max_prompt_tokens=args.max_prompt_tokens,
                              max_new_tokens=args.max_new_tokens)
    total_new = sum(r.max_new_tokens for r in rows)

    def requests():
        return [Request(r.request_id, list(r.token_ids), r.max_new_tokens) for r in rows]  # no EOS: fixed lengths

    results: dict[str, float] = {}

    # baseline: transformers generate, left-padded batches
    torch.set_num_threads(args.baseline_threads)
    dev = "cuda:0" if args.device == "cuda" else "cpu"
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt.path), dtype=torch.float32).to(dev).eval()
    pad = ckpt.config.pad_token_id if ckpt.config.pad_token_id is not None else 0
    t0 = time.perf_counter()
    produced = 0
    for i in range(0, len(rows), args.micro_batch_size):
        chunk = rows[i:i + args.micro_batch_size]
        width = max(len(r.token_ids) for r in chunk)
        ids = torch.tensor([[pad] * (width - len(r.token_ids)) + r.token_ids for r in chunk])
        mask = torch.tensor([[0] * (width - len(r.token_ids)) + [1] * len(r.token_ids) for r in chunk])
        n_new = max(r.max_new_tokens for r in chunk)
        with torch.inference_mode():
            hf.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n_new, min_new_tokens=n_new,
                        do_sample=False, pad_token_id=pad)
        produced += sum(r.max_new_tokens for r in chunk)  # tokens past a row's own cap are not counted
    sync()
    results["hf_generate"] = produced / (time.perf_counter() - t0)
    del hf

    # FlexPipe code, one process
    local = LocalPipeline.from_layer_ranges(ckpt, [(0, ckpt.num_layers)], num_blocks=1024, block_size_tokens=16)
    if args.device == "cuda":
        local = LocalPipeline([st.to(dev) for st in local.stages], 1024, 16)
    t0 = time.perf_counter()
    outs = local.generate(requests(), micro_batch_size=args.micro_batch_size)
    sync()
    results["local_1stage"] = sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - t0)
    del local
    torch.set_num_threads(1)

    for stages in (2, 3):
        gear = even_gear(ckpt.num_layers, stages, ckpt.name, args.micro_batch_size, stages, 16384)
        with PipelineRuntime(gear, ckpt, RuntimeOptions(device=args.device)) as rt:
            t0 = time.perf_counter()
            outs = rt.generate(requests())
            results[f"pipeline_{stages}stage"] = sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - t0)

    if args.score:
        score_bench(ckpt, rows, args)

    base = results["hf_generate"]
    where = (f"device cuda: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, pipelines over "
             f"{cuda_backend(2)} (2 stages) / {cuda_backend(3)} (3 stages)" if args.device == "cuda"
             else f"host cpus={os.cpu_count()}, baseline threads={args.baseline_threads}")
    print(f"workload: {len(rows)} requests (Azure conv trace), prompt <= {args.max_prompt_tokens} tokens, "
          f"{total_new} output tokens; {where}")
    print(f"{'configuration':<18}{'output tok/s':>14}{'vs hf_generate':>16}")
    for name, tps in results.items():
        print(f"{name:<18}{tps:>14.1f}{tps / base:>15.2f}x")
    if not args.no_fidelity:
        fidelity(args)


def score_bench(ckpt, rows, args) -> None:
    """Prefill-only scoring: DeepSpeed PipelineModule (2 ranks) vs one transformers process."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from flexpipe_dag.core.gear_builders import even_gear
    from flexpipe_dag.runtime.batch import JsonlSink, PromptRow
    from flexpipe_dag.runtime.score_runtime import ScoreOptions, run_score_job

    prompts = [PromptRow(r.request_id, token_ids=r.token_ids) for r in rows if len(r.token_ids) > 1]
    tokens = sum(len(r.token_ids) for r in prompts)
    torch.set_num_threads(args.baseline_threads)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt.path), dtype=torch.float32).eval()
    pad = ckpt.config.pad_token_id if ckpt.config.pad_token_id is not None else 0
    ordered = sorted(prompts, key=lambda r: -len(r.token_ids))
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(ordered), args.micro_batch_size):
            chunk = ordered[i:i + args.micro_batch_size]
            width = max(len(r.token_ids) for r in chunk)
            ids = torch.tensor([r.token_ids + [pad] * (width - len(r.token_ids)) for r in chunk])
            torch.log_softmax(hf(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
    hf_tps = tokens / (time.perf_counter() - t0)
    del hf
    torch.set_num_threads(1)
    gear = even_gear(ckpt.num_layers, 2, ckpt.name, args.micro_batch_size, 2, 16384)
    with tempfile.TemporaryDirectory() as tmp:
        report = run_score_job(gear, prompts, JsonlSink(Path(tmp) / "scores.jsonl"), model=ckpt,
                               options=ScoreOptions(micro_batch_size=args.micro_batch_size // 2 or 1, max_micro_batches=2,
                                                    keep_token_logprobs=False))
    if report.failure:
        raise SystemExit(f"scoring failed: {report.failure}")
    print(f"scoring: {len(prompts)} prompts, {tokens} prompt tokens; DeepSpeed ranks started in {report.start_s:.1f} s")
    print(f"{'configuration':<26}{'prompt tok/s':>14}{'vs hf_forward':>15}")
    print(f"{'hf_forward':<26}{hf_tps:>14.1f}{1.0:>14.2f}x")
    ds_tps = report.forward_tokens_per_s
    print(f"{'deepspeed_pipe_2stage':<26}{ds_tps:>14.1f}{ds_tps / hf_tps:>14.2f}x")


def fidelity(args) -> None:
    """Simulator fidelity on the same kind of gear and workload (see ``bench/fidelity_bench.py``)."""
    from fidelity_bench import print_fidelity, run_fidelity

    print("\nfidelity: serving simulator vs this runtime, same 2-stage gear and requests")
    print_fidelity(run_fidelity(num_requests=args.num_requests, max_prompt_tokens=args.max_prompt_tokens,
                                max_new_tokens=args.max_new_tokens))


if __name__ == "__main__":
    main()
