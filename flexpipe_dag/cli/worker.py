"""``flexpipe worker``: serve one stage of a pipeline whose head runs on another host.

Start the head (``flexpipe run ... --listen HOST:PORT``, or a Dagster ``batch_inference`` run with
``control_address`` in its config) and one worker per stage replica, on the host that should run it:

    flexpipe worker --head gpu-a100-0:29501 --secret-file run.secret --stage 1 --device cuda --local-rank 0

``--secret-file`` is a copy of the file the head wrote (its startup message names it; or
``FLEXPIPE_RUN_SECRET_FILE`` / ``FLEXPIPE_RUN_SECRET`` in the environment): the worker proves it to
the head before anything else, and checks that the head holds it too.

The worker claims its stage, takes the gear (layer ranges, KV pool) from the head, loads only its
own layers of the model (resolved on this host; it must be the model the head serves), serves
until the head stops the pipeline, and exits 0. A stage with replicas takes one worker per replica
(``--replica K``). Under a launcher, rank ``r`` serves worker slot ``r - 1`` (stages in order,
replicas together) and ``--local-rank`` defaults to ``LOCAL_RANK``.
"""

from __future__ import annotations

import argparse
import os

from flexpipe_dag.core.errors import InputError


def register(subparsers) -> None:
    p = subparsers.add_parser("worker", help="serve one pipeline stage for a head on another host")
    p.add_argument("--head", required=True, help="HOST:PORT of the head's control store")
    p.add_argument("--secret-file", default=None,
                   help="the run secret the head wrote (default: FLEXPIPE_RUN_SECRET_FILE / FLEXPIPE_RUN_SECRET)")
    p.add_argument("--stage", type=int, default=None, help="stage index (default: from RANK under a launcher)")
    p.add_argument("--replica", type=int, default=0, help="which replica of a replicated stage (default 0)")
    p.add_argument("--model", default=None, help="HF directory or GGUF file on this host (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: what the head asks for")
    p.add_argument("--local-rank", type=int, default=None, help="GPU index on this host (default: LOCAL_RANK or 0)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for this stage (default: the head's)")
    p.add_argument("--connect-timeout-s", type=float, default=600.0, help="how long to wait for the head")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the reasons are ours; no C++ store retry noise
    from flexpipe_dag.core.settings import env_value
    from flexpipe_dag.runtime.control_auth import resolve_secret
    from flexpipe_dag.runtime.remote import serve_stage

    stage, worker = args.stage, None
    if stage is None:
        rank = env_value("RANK", int)
        if rank is None or rank < 1:
            raise InputError(None, "--stage", "expected a stage index (or RANK >= 1 from a launcher)")
        worker = rank - 1
    local_rank = args.local_rank if args.local_rank is not None else env_value("LOCAL_RANK", int, 0)
    if args.threads is not None and args.threads < 1:
        raise InputError(None, "--threads", f"expected an integer >= 1, got {args.threads}")
    if not args.connect_timeout_s > 0:
        raise InputError(None, "--connect-timeout-s", f"expected a positive number, got {args.connect_timeout_s}")
    return serve_stage(args.head, stage, model=args.model, device=args.device, local_rank=local_rank,
                       connect_timeout_s=args.connect_timeout_s, threads=args.threads, replica=args.replica,
                       worker=worker, secret=resolve_secret(args.secret_file))
