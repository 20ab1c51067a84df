"""Shift executor on the real runtime (CPU, SmolLM2): step timings and what the caller feels.

Serves a steady stream of requests through a :class:`ServingRouter` and shifts mid-run from a
1-stage to a 2-stage gear, twice: once with the shadow warm-up (both gears resident), once as a
stop-the-world baseline (the same shift forced into ``cold`` mode by a tight device memory: hold,
drain, stop the old gear, start the new one). Prints the executor's step timings, requests lost or
duplicated (must be 0), and the worst end-to-end latency of requests submitted during each shift,
with the shadow / baseline ratio.

    OMP_NUM_THREADS=1 .venv/bin/python bench/shift_executor_bench.py [--interval-s 1.0] [--max-new-tokens 12]
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Count: 1, 2, 3, 4,",
           "The quick brown fox", "Tell me a joke about computers.", "Name three colors."]


def _gear(ranges, gear_id):
    from flexpipe_dag.core.gear import Gear, StagePlan

    return Gear(gear_id=gear_id, kind="manual", model_name="SmolLM2-135M-Instruct", num_layers=30,
                micro_batch_size=4, max_inflight_micro_batches=2, kv_capacity_tokens=2048, kv_block_size_tokens=16,
                stages=[StagePlan(stage_index=i, layer_start=a, layer_end=b, device_ids=[f"cpu{i}"])
                        for i, (a, b) in enumerate(ranges)])


def run_once(ckpt, prompt_ids, cold: bool, interval_s: float, max_new_tokens: int) -> dict:
    from flexpipe_dag.runtime.pipeline import PipelineRuntime, RuntimeOptions, stage_memory_bytes
    from flexpipe_dag.runtime.scheduler import Request
    from flexpipe_dag.shift import GearExecutor, ServingRouter, ShiftConfig

    old_gear, new_gear = _gear([(0, 30)], "one-stage"), _gear([(0, 8), (8, 30)], "two-stage")
    options = None
    if cold:
        cap = int(stage_memory_bytes(old_gear, ckpt)[0]["total_bytes"] * 1.05)
        options = RuntimeOptions(device_memory_bytes={"cpu0": cap, "cpu1": 8 * 2**30})
    submitted_s: dict[str, float] = {}
    delivered = collections.Counter()
    latency_s: dict[str, float] = {}

    def on_result(out):
        delivered[out.request_id] += 1
        latency_s[out.request_id] = time.monotonic() - submitted_s[out.request_id]

    eos = ckpt.eos_token_ids()
    stop = threading.Event()
    window = {}

    def load():
        k = 0
        while not stop.is_set() or k < window.get("tail_until", 0):
            rid = f"r{k}"
            submitted_s[rid] = time.monotonic()
            router.submit([Request(rid, list(prompt_ids[k % len(prompt_ids)]), max_new_tokens, eos_token_ids=eos)])
            k += 1
            time.sleep(interval_s)

    router = ServingRouter(on_result=on_result)
    with router:
        router.open(PipelineRuntime(old_gear, ckpt, options))
        th = threading.Thread(target=load, daemon=True)
        th.start()
        time.sleep(3 * interval_s)
        t0 = time.monotonic()
        outcome = GearExecutor(router, ShiftConfig(health_window_s=2.0, probe_interval_s=0.5)).shift(new_gear)
        t1 = time.monotonic()
        window["tail_until"] = len(submitted_s) + 3
        stop.set()
        th.join()
        router.wait_idle(timeout_s=300)
    during = [latency_s[r] for r, t in submitted_s.items() if t0 <= t <= t1 and r in latency_s]
    before = [latency_s[r] for r, t in submitted_s.items() if t < t0 and r in latency_s]
    return {"outcome": outcome, "lost": len(set(submitted_s) - set(delivered)),
            "duplicated": sum(1 for c in delivered.values() if c > 1), "requests": len(submitted_s),
            "max_e2e_during_s": max(during, default=float("nan")),
            "p50_e2e_before_s": sorted(before)[len(before) // 2] if before else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval-s", type=float, default=1.0, help="seconds between request arrivals")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    args = ap.parse_args()
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint

    ckpt = resolve_checkpoint()
    tok = ckpt.tokenizer()
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for p in PROMPTS]
    rows = {}
    for name, cold in (("shadow", False), ("stop-the-world", True)):
        r = run_once(ckpt, prompt_ids, cold, args.interval_s, args.max_new_tokens)
        o = r["outcome"]
        rows[name] = r
        print(f"{name:15s} status={o.status} mode={o.mode} requests={r['requests']} lost={r['lost']} "
              f"duplicated={r['duplicated']} p50_e2e_before={r['p50_e2e_before_s']:.2f}s "
              f"max_e2e_during_shift={r['max_e2e_during_s']:.2f}s")
        print(f"{'':15s} timings_s={o.timings_s} start_s={o.details.get('start_s')}")
    ratio = rows["shadow"]["max_e2e_during_s"] / rows["stop-the-world"]["max_e2e_during_s"]
    print(f"worst e2e latency during the shift, shadow / stop-the-world: {ratio:.2f}")


if __name__ == "__main__":
    main()
