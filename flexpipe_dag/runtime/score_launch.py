"""One scoring rank started by an external launcher: DeepSpeed's ``deepspeed`` (hostfile, several
hosts) or ``torch.distributed.run``. Every rank runs this module with the same arguments.

    deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 1 \\
        --module flexpipe_dag.runtime.score_launch --gear gear.json --prompts rows.jsonl --out scores.jsonl

    python -m torch.distributed.run --nnodes 2 --nproc_per_node 1 --node_rank N \\
        --master_addr HOST0 --master_port 29500 \\
        -m flexpipe_dag.runtime.score_launch --gear gear.json --prompts rows.jsonl --out scores.jsonl

The launcher sets ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT``;
world size must equal the gear's stage count and rank ``s`` serves stage ``s``. Every rank reads the
same gear, prompts file and model (same paths on every host, or a shared filesystem) and derives the
same batch plan. The last stage's rank writes ``--out`` (JSONL, idempotent per id: a re-run writes
only rows missing there; the ranks still score every row, because they cannot all see that file).
Backend: gloo on CPU, NCCL with ``--device cuda`` (stage on ``cuda:LOCAL_RANK``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flexpipe_dag.runtime.score_launch", description=__doc__.splitlines()[0])
    ap.add_argument("--gear", type=Path, required=True, help="gear JSON (one rank per stage)")
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL / Parquet rows: id, prompt | token_ids, "
                                                                "continuations (optional)")
    ap.add_argument("--out", type=Path, required=True, help="scores JSONL, written by the last stage's rank")
    ap.add_argument("--model", default=None, help="HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="default: the gear's")
    ap.add_argument("--max-micro-batches", type=int, default=None, help="default: the gear's in-flight limit")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", default="fp32")
    args, _unknown = ap.parse_known_args(argv)  # the deepspeed launcher may append --local_rank=N

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from flexpipe_dag.core.gear_builders import load_gear
    from flexpipe_dag.runtime.batch import JsonlSink, read_prompts
    from flexpipe_dag.runtime.model_loader import resolve_checkpoint
    from flexpipe_dag.runtime.pipeline import check_gear_supported
    from flexpipe_dag.runtime.score_runtime import ScoreSpec, run_score_rank, score_units
    from flexpipe_dag.runtime.scoring import ScoreCollector

    gear = load_gear(args.gear)
    check_gear_supported(gear)
    ckpt = resolve_checkpoint(args.model)
    rows, malformed = read_prompts(args.prompts)
    units, state = score_units(rows, ckpt.tokenizer(), malformed, ckpt.max_context_tokens)
    rank = int(os.environ.get("RANK", "0"))
    pad = ckpt.config.pad_token_id if ckpt.config.pad_token_id is not None else 0
    spec = ScoreSpec(str(ckpt.path), ckpt.name, gear.layer_ranges(), units,
                     args.micro_batch_size or gear.micro_batch_size,
                     args.max_micro_batches or gear.max_inflight_micro_batches, int(pad), args.dtype,
                     "nccl" if args.device == "cuda" else "gloo")
    last = rank == gear.num_stages - 1
    collector = ScoreCollector(units, state, JsonlSink(args.out), gear.gear_id) if last else None

    def emit(event: tuple) -> None:
        if event[0] == "ready":
            print(f"rank {rank}: stage {event[1]} ready {event[2]}", file=sys.stderr, flush=True)
        elif event[0] == "scores" and collector is not None:
            collector.add(event[1])

    run_score_rank(spec, emit)
    if collector is not None:
        print(f"rank {rank}: {collector.finished} rows scored into {args.out}; {len(malformed)} malformed",
              file=sys.stderr, flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
