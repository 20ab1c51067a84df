"""Output tokens/s of FlexPipe's runtime (1, 2, 3 stages) vs single-process transformers, per batch size.

Workload: the first N requests of the Azure conv trace (bundled slice), prompt lengths capped at
--max-prompt-tokens and outputs at --max-new-tokens, prompt text cut from the bundled corpus; EOS
is ignored (every request produces exactly its max_new_tokens) so every configuration produces
the same number of tokens. For each batch size B (--batch-sizes, default 1, 8, 32):

* ``hf_generate`` (the baseline): ``transformers`` ``generate`` (greedy, KV cache), batches of B rows
  with left padding, one process using all --baseline-threads threads;
* ``hf_generate_1thread`` (CPU): the same with one thread, so the table shows what the baseline's threads give
  it (a pipeline of N one-thread stages is measured against that);
* ``local_1stage``: FlexPipe's stage code and scheduler in one process, one thread, micro-batches of B;
* ``pipeline_Nstage``: one process per stage + a driver, one thread each, gloo over loopback,
  micro-batches of B, as many in flight as keep every stage busy (``inflight_to_fill``: max(ceil(requests / B),
  N), the planner's rule for a gear sized for that concurrency and ``flexpipe run``'s default), layers split as
  ``flexpipe run --stages N`` splits them for these prompts (``--split workload``: the min-bottleneck split of
  the workload's modelled time, one worker measured here; the LM head weighs per sampled token, a layer per
  token);
* ``pipeline_Nstage_even``: the same with the layers split evenly (``--split even``), the split's gain;
* ``pipeline_Nstage_1perstage``: the same with one micro-batch in flight per stage (what this bench ran before;
  the gap is each stage's wait for the driver's turn between a result and the next micro-batch); not run where
  the two are the same (B = 32: 64 requests make 2 micro-batches).

Every configuration runs --rounds times, interleaved (baseline, local, pipelines, baseline, ...),
and the median tokens/s is printed with its ratio to the baseline's median: this host's speed
drifts by 10-25 % over minutes, which a single back-to-back pair cannot separate from a real change.
Start-up (model load) is excluded from every figure. After the table, where each pipeline's time goes: each
stage's compute seconds by step kind and its send seconds, read from the stages' own step records (the
calibration's observations), its busy share of the wall time, and two bounds on the pipeline's tokens/s: its
bottleneck stage computing without a pause, and the stages' summed compute shared evenly. Then where the time of one
``local_1stage`` decode step goes at each batch size (``torch.profiler``: matrix products, attention,
everything else), and the calibration fidelity (``bench/fidelity_bench.py``, unless --no-fidelity),
whose fitted per-step overhead factor is the runtime's dispatch cost as the cost model sees it.

With ``--score``: also the prefill-only scoring path (log-prob of every prompt token) on DeepSpeed's
PipelineModule with the 2-stage even gear, against a single-process ``transformers`` forward over
the same right-padded batches.

With ``--device cuda`` every configuration runs on GPUs in --dtype (default ``auto``: bf16 where the
GPU has it, else fp16; the baseline in the same dtype): the baseline and ``local_1stage`` on
``cuda:0``, pipeline stage ``s`` on ``cuda:<s mod GPU count>``; synchronised timings. It also prints
the decode step time at each batch size against the weights-read bound (the stage's weight bytes
over the GPU's memory bandwidth, --hbm-gbps).

Usage: OMP_NUM_THREADS=1 python bench/runtime_bench.py [--num-requests 64] [--batch-sizes 1,8,32]
       [--rounds 2] [--max-new-tokens 16] [--score] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start / stop lines

TRACE = Path(__file__).resolve().parent.parent / "flexpipe_dag" / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"


def workload_splits(ckpt, rows, depths, batch_sizes, dev: str, dtype: str):
    """Layers per stage for each depth and micro-batch size, as ``flexpipe run --stages N`` splits them for these
    prompts (:func:`~flexpipe_dag.profiling.worker_split.split_for_workload`, one worker measured here), and per
    micro-batch size the workload as priced (:class:`~flexpipe_dag.planner.workload_split.WorkloadCost`), which
    gives any split's modelled stage times."""
    from flexpipe_dag.planner.model_spec import load_model_spec
    from flexpipe_dag.profiling.worker_split import measure_worker, split_for_workload

    spec = load_model_spec(ckpt.path)
    prompts, outputs = [len(r.token_ids) for r in rows], [r.max_new_tokens for r in rows]
    splits, work = {}, {}
    for b in batch_sizes:
        worker = measure_worker(dev, dtype, b)
        for n in depths:
            split = split_for_workload(spec, worker, dtype, n, prompts, outputs, b)
            splits[(n, b)], work[b] = split.layers_per_stage, split.work
    return splits, work


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--batch-sizes", default="1,8,32",
                    help="comma-separated: sequences per micro-batch of the FlexPipe runs and rows per transformers "
                         "generate batch of the baseline, so both batch alike")
    ap.add_argument("--stages", default="2,3", help="comma-separated pipeline depths to run")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every configuration")
    ap.add_argument("--baseline-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--score", action="store_true", help="also bench the DeepSpeed scoring path")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", default="auto", help="fp32, bf16, fp16 or auto (fp32 on CPU, bf16/fp16 on GPU)")
    ap.add_argument("--decode-graphs", default="auto", choices=("auto", "off", "eager"),
                    help="decode steps as CUDA graphs (auto: on a GPU; with --device cuda the run also prints "
                         "local_1stage without them, local_1stage_nographs, for the gain)")
    ap.add_argument("--hbm-gbps", type=float, default=None,
                    help="GPU memory bandwidth, GB/s, for the weights-read bound (default: the catalog's figure for "
                         "the GPU's name, e.g. 4800 for an H200)")
    ap.add_argument("--no-fidelity", action="store_true",
                    help="skip the simulator-vs-measured TTFT / TPOT comparison (bench/fidelity_bench.py)")
    args = ap.parse_args()
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    depths = [int(x) for x in args.stages.split(",") if x]

    import torch

    from flexpipe_dag.core.gear_builders import even_layer_counts, inflight_to_fill, manual_gear
    from flexpipe_dag.runtime.batch import prompts_from_trace
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint, resolve_dtype
    from flexpipe_dag.runtime.observations import ObservationCollector
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions, cuda_backend
    from flexpipe_dag.runtime.scheduler import Request

    dev = "cuda:0" if args.device == "cuda" else "cpu"
    dtype = resolve_dtype(args.dtype, dev)
    ckpt = resolve_checkpoint()
    tok = ckpt.tokenizer()
    rows = prompts_from_trace(args.trace, tok, num_requests=args.num_requests, max_prompt_tokens=args.max_prompt_tokens,
                              max_new_tokens=args.max_new_tokens)
    total_new = sum(r.max_new_tokens for r in rows)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def requests(tag: str):
        return [Request(f"{tag}-{r.request_id}", list(r.token_ids), r.max_new_tokens) for r in rows]  # no EOS

    splits, work = workload_splits(ckpt, rows, depths, batch_sizes, dev, dtype)
    splits.update({(n, 0): even_layer_counts(ckpt.num_layers, n) for n in depths})  # 0: the even split, any batch
    runs: dict[int, dict[str, list[float]]] = {b: {} for b in batch_sizes}
    times: dict[int, dict[str, list[dict]]] = {b: {} for b in batch_sizes}  # per pipeline run: stage_times
    for rnd in range(args.rounds):
        for b in batch_sizes:
            res = runs[b]
            res.setdefault("hf_generate", []).append(hf_generate(ckpt, rows, b, args.baseline_threads, dev, dtype, sync))
            if args.device == "cpu" and args.baseline_threads > 1:  # what the baseline's threads give it
                res.setdefault("hf_generate_1thread", []).append(hf_generate(ckpt, rows, b, 1, dev, dtype, sync))
            torch.set_num_threads(1)
            res.setdefault("local_1stage", []).append(local_generate(ckpt, requests(f"l{rnd}"), b, dev, dtype, sync,
                                                                     args.decode_graphs))
            if args.device == "cuda" and args.decode_graphs != "off":
                res.setdefault("local_1stage_nographs", []).append(
                    local_generate(ckpt, requests(f"n{rnd}"), b, dev, dtype, sync, "off"))
            for n in depths:
                fill = inflight_to_fill(n, len(rows), b)
                variants = [(f"pipeline_{n}stage", fill, b), (f"pipeline_{n}stage_even", fill, 0)]
                if fill > n:
                    variants.append((f"pipeline_{n}stage_1perstage", n, b))
                for name, inflight, split in variants:
                    gear = manual_gear(splits[(n, split)], gear_id=f"bench-{n}", model_name=ckpt.name,
                                       micro_batch_size=b, max_inflight_micro_batches=inflight, kv_capacity_tokens=16384)
                    with PipelineRuntime(gear, ckpt, RuntimeOptions(device=args.device, dtype=args.dtype,
                                                                   decode_graphs=args.decode_graphs)) as rt:
                        collector = ObservationCollector(rt, "bench")
                        t0 = time.perf_counter()
                        outs = rt.generate(requests(f"{name}{rnd}"))
                        wall_s = time.perf_counter() - t0
                        tps = sum(len(o.output_token_ids) for o in outs) / wall_s
                        times[b].setdefault(name, []).append(stage_times(collector.collect(), splits[(n, split)],
                                                                         wall_s, work[b]))
                    res.setdefault(name, []).append(tps)
            print(f"round {rnd + 1}/{args.rounds}, batch {b}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in res.items()),
                  flush=True)

    where = (f"device cuda: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, {dtype}, pipelines over "
             f"{cuda_backend(2)} (2 stages) / {cuda_backend(3)} (3 stages)" if args.device == "cuda"
             else f"host cpus={os.cpu_count()}, baseline threads={args.baseline_threads}, {dtype}")
    print(f"\nworkload: {len(rows)} requests (Azure conv trace), prompt <= {args.max_prompt_tokens} tokens, "
          f"{total_new} output tokens; {where}; median of {args.rounds} interleaved round(s)")
    print("pipeline splits (layers per stage; _even: " + ", ".join(str(splits[(n, 0)]) for n in depths) + "): "
          + "; ".join(f"batch {b}: " + ", ".join(str(splits[(n, b)]) for n in depths) for b in batch_sizes))
    print(f"{'batch':>5}  {'configuration':<27}{'output tok/s':>14}{'vs hf_generate':>16}{'spread':>10}")
    for b in batch_sizes:
        base = statistics.median(runs[b]["hf_generate"])
        for name, values in runs[b].items():
            med = statistics.median(values)
            spread = (max(values) - min(values)) / med if med else 0.0
            print(f"{b:>5}  {name:<27}{med:>14.1f}{med / base:>15.2f}x{100 * spread:>9.0f}%")
    print_stage_times(runs, times, total_new)
    step_profile(ckpt, rows, batch_sizes, dev, dtype, args.hbm_gbps)
    if args.score:
        score_bench(ckpt, rows, args)
    if not args.no_fidelity and args.device == "cpu":
        fidelity(args)


def hf_generate(ckpt, rows, batch: int, threads: int, dev: str, dtype: str, sync) -> float:
    """Output tokens/s of ``transformers`` ``generate`` over ``rows`` in left-padded batches of ``batch``."""
    import torch
    from transformers import AutoModelForCausalLM

    from flexpipe_dag.runtime.model_loader import torch_dtype

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt.path), dtype=torch_dtype(dtype)).to(dev).eval()
    pad = ckpt.config.pad_token_id if ckpt.config.pad_token_id is not None else 0
    sync()
    t0 = time.perf_counter()
    produced = 0
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        width = max(len(r.token_ids) for r in chunk)
        ids = torch.tensor([[pad] * (width - len(r.token_ids)) + r.token_ids for r in chunk])
        mask = torch.tensor([[0] * (width - len(r.token_ids)) + [1] * len(r.token_ids) for r in chunk])
        n_new = max(r.max_new_tokens for r in chunk)
        with torch.inference_mode():
            hf.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n_new, min_new_tokens=n_new,
                        do_sample=False, pad_token_id=pad)
        produced += sum(r.max_new_tokens for r in chunk)  # tokens past a row's own cap are not counted
    sync()
    return produced / (time.perf_counter() - t0)


def _local(ckpt, dev: str, dtype: str, decode_graphs: str = "auto"):
    from flexpipe_dag.runtime.local import LocalPipeline

    local = LocalPipeline.from_layer_ranges(ckpt, [(0, ckpt.num_layers)], num_blocks=1024, block_size_tokens=16,
                                            dtype=dtype, decode_graphs=decode_graphs)
    if dev != "cpu":
        local = LocalPipeline([st.to(dev) for st in local.stages], 1024, 16, decode_graphs)
    return local


def stage_times(observations, layers_per_stage: list[int], wall_s: float, work) -> dict:
    """Where one pipeline run's time went, from its stages' step records
    (:class:`~flexpipe_dag.runtime.observations.ObservationCollector`): per stage, the seconds its steps
    computed, by step kind (``prefill`` / ``decode`` / ``mixed``), and the seconds it spent handing
    activations on (sender side), beside the compute seconds the workload split modelled for it (``work``, a
    :class:`~flexpipe_dag.planner.workload_split.WorkloadCost`); ``wall_s`` the run's wall time."""
    busy = [{"prefill": 0.0, "decode": 0.0, "mixed": 0.0, "send": 0.0} for _ in layers_per_stage]
    for o in observations:
        busy[o.stage_index][o.kind] += o.wall_ms / 1e3
        busy[o.stage_index]["send"] += (o.send_ms or 0.0) / 1e3
    last = len(layers_per_stage) - 1
    modelled_s = [work.stage_ms(n, s == 0, s == last) / 1e3 for s, n in enumerate(layers_per_stage)]
    return {"wall_s": wall_s, "stages": busy, "layers": layers_per_stage, "modelled_s": modelled_s}


def print_stage_times(runs, times, total_new: int) -> None:
    """Where each pipeline's time goes (mean over rounds), each stage's compute against what the workload split
    modelled for it (the split's promise: a ratio near 1 on every stage, and alike across stages, means the
    split balanced what it meant to), and two bounds on its tokens/s: the
    bottleneck stage computing without a pause (what the runtime could still gain at this split) and
    the stages' summed compute shared evenly (what a split balancing the stages for this workload could
    give; the LM head, on the last stage, is one indivisible piece, so this is an upper bound)."""
    print("\nwhere each pipeline's time goes (mean of the rounds): a stage's compute s by step kind "
          "(prefill / decode / mixed), its send s (handing activations on), its busy share of the wall time, and "
          "its compute / the workload split's modelled s")
    print(f"{'batch':>5}  {'configuration':<27}{'wall s':>7}  stages: layers compute(prefill/decode/mixed) "
          "send busy% measured/modelled   bound: bottleneck never waiting / work split evenly, tok/s (x hf_generate)")
    for b, per_config in times.items():
        base = statistics.median(runs[b]["hf_generate"])
        for name, rounds in per_config.items():
            n = len(rounds[0]["stages"])
            wall = statistics.fmean(r["wall_s"] for r in rounds)
            cells, computes = [], []
            for s in range(n):
                kinds = {k: statistics.fmean(r["stages"][s][k] for r in rounds) for k in rounds[0]["stages"][s]}
                compute = kinds["prefill"] + kinds["decode"] + kinds["mixed"]
                computes.append(compute)
                modelled = statistics.fmean(r["modelled_s"][s] for r in rounds)
                cells.append(f"[{rounds[0]['layers'][s]}] {compute:.1f}({kinds['prefill']:.1f}/{kinds['decode']:.1f}/"
                             f"{kinds['mixed']:.1f}) {kinds['send']:.2f} {100 * compute / wall:.0f}% "
                             f"{compute / modelled:.2f}x")
            tps = total_new / wall
            bottleneck = total_new / max(computes)
            even = total_new / (sum(computes) / n)
            print(f"{b:>5}  {name:<27}{wall:>7.1f}  " + "; ".join(cells)
                  + f"   {tps:.1f} -> {bottleneck:.1f} ({bottleneck / base:.2f}x) / {even:.1f} ({even / base:.2f}x)")


def local_generate(ckpt, reqs, batch: int, dev: str, dtype: str, sync, decode_graphs: str = "auto") -> float:
    """Output tokens/s of FlexPipe's stage code and scheduler in this process (one stage, micro-batches of
    ``batch``; ``decode_graphs`` as ``RuntimeOptions.decode_graphs``). The first steps of each decode shape
    capture its graph inside the timed run, as a server's first requests would."""
    local = _local(ckpt, dev, dtype, decode_graphs)
    sync()
    t0 = time.perf_counter()
    outs = local.generate(reqs, micro_batch_size=batch)
    sync()
    return sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - t0)


def step_profile(ckpt, rows, batch_sizes, dev: str, dtype: str, hbm_gbps: float | None) -> None:
    """Where one decode step of ``local_1stage`` spends its time, per batch size (``torch.profiler``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from flexpipe_dag.runtime.kv_blocks import BlockAllocator
    from flexpipe_dag.runtime.scheduler import Request, Scheduler

    local = _local(ckpt, dev, dtype, "off")  # no CUDA graphs: the profiler attributes every kernel
    gemm = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
    attention = ("aten::_scaled_dot_product", "aten::scaled_dot_product")
    weights = sum(st.param_bytes() for st in local.stages)
    bound = ""
    if dev != "cpu":
        gbps = hbm_gbps or _catalog_bandwidth_gbps(torch.cuda.get_device_name(0))
        if gbps:
            bound = f"; weights-read bound {weights / (gbps * 1e9) * 1e3:.3f} ms ({weights / 2**20:.0f} MiB at {gbps:g} GB/s)"
    print(f"\none local_1stage decode step without CUDA graphs (median of 8 after warm-up; torch.profiler self "
          f"time{bound}):")
    print(f"{'batch':>5} {'step ms':>9} {'matmul ms':>10} {'attention ms':>13} {'other ms':>9}  other = norms, rotary, "
          "gathers, sampling, Python dispatch")
    sync = torch.cuda.synchronize if dev != "cpu" else (lambda: None)
    for b in batch_sizes:
        sched = Scheduler(BlockAllocator(1024, 16), b, 1)
        sched.add_requests([Request(f"s{i}", list(rows[i % len(rows)].token_ids), 64) for i in range(b)])
        mb = sched.schedule()
        while any(len(s.token_ids) > 1 for s in mb.seqs):  # prefill first
            sched.update_from_output(mb.mb_id, local.step(mb))
            mb = sched.schedule()
        times = []
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev != "cpu" else [])
        for i in range(12):
            if i == 4:
                prof = profile(activities=activities)
                prof.__enter__()
            sync()
            t0 = time.perf_counter()
            tokens = local.step(mb)
            sync()
            if i >= 4:
                times.append((time.perf_counter() - t0) * 1e3)
            sched.update_from_output(mb.mb_id, tokens)
            mb = sched.schedule()
        prof.__exit__(None, None, None)
        events = prof.key_averages()
        attr = "self_device_time_total" if dev != "cpu" else "self_cpu_time_total"
        total = {"gemm": 0.0, "attention": 0.0}
        for e in events:
            t = getattr(e, attr, 0.0) / 1e3 / len(times)
            if e.key.startswith(gemm):
                total["gemm"] += t
            elif e.key.startswith(attention):
                total["attention"] += t
        step = statistics.median(times)
        print(f"{b:>5} {step:>9.2f} {total['gemm']:>10.2f} {total['attention']:>13.2f} "
              f"{max(step - total['gemm'] - total['attention'], 0.0):>9.2f}")


def _catalog_bandwidth_gbps(device_name: str) -> float | None:
    """The catalog's memory bandwidth for an NVML device name (None when the catalog has no match)."""
    from flexpipe_dag.core.catalog import lookup_gpu

    spec = lookup_gpu(device_name)
    return spec.hbm_bandwidth_gbps if spec else None


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
